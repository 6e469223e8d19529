"""`python -m sglang_router.launch_router` of the fake package: the fake router's CLI."""

from fake_router import main_router

if __name__ == "__main__":
    main_router()
