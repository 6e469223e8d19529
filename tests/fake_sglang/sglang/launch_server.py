"""`python -m sglang.launch_server` of the fake package: the fake server's CLI."""

from fake_server import main_server

if __name__ == "__main__":
    main_server()
