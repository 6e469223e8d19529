"""SGLang's own request code on the routed-experts request asyncrl's client sends (what R3 asks
of an engine), per supported release, from its wheel (tests/fake_sglang/upstream_exec.py).

Facts this holds: `return_routed_experts` on /generate and `--enable-return-routed-experts` at
launch exist from SGLang 0.5.10 on; the flag is one bool per body (SGLang hands every item of a
batch the body's value as it is: a per-item list would reach each item whole), which every item
then carries to the scheduler; 0.5.6 refuses both. (The hf engine's reply is SGLang's format: base64 of int32
[prompt + output - 1, layers, top_k]; `actor.router_replay: r3` with SGLang engines needs
`enable_return_routed_experts: true` in their strategy_config, which the launch passes on.)
"""

from __future__ import annotations

from asyncrl.engine.replies import GenerateRequest, generate_body
from asyncrl.engine.sglang import SGLangSettings, server_command
from asyncrl.engine.versions import CONTRACT_VERSIONS
from tests.fake_sglang.wheels import run_upstream

FIRST = (0, 5, 10)


def test_sglang_takes_the_routed_experts_request_from_0_5_10():
    reqs = [GenerateRequest([3, 4, 5], {"max_new_tokens": 4}, return_routed_experts=True)] * 2
    body = generate_body(reqs, batched=True, namespace="v0")
    assert body["return_routed_experts"] is True
    # The launch as asyncrl builds it from actor_infer's strategy_config (`actor.router_replay:
    # r3` with sglang engines requires the key: config/moe_checks.py).
    settings = SGLangSettings.parse({"enable_return_routed_experts": True})
    launch = server_command("/m", 30000, 1, settings)[3:]  # after `python -m sglang.launch_server`
    assert "--enable-return-routed-experts" in launch
    ran = run_upstream(
        {v: {"generate": [body], "structs": [], "server_args": [launch]} for v in CONTRACT_VERSIONS}
    )
    for version, result in ran.items():
        assert "crash" not in result, result.get("crash")
        (generated,) = result["generate"]
        (launched,) = result["server_args"]
        if tuple(int(x) for x in version.split(".")) >= FIRST:
            assert generated["error"] is None and launched is None, (version, result)
            assert [s["return_routed_experts"] for s in generated["subs"]] == [True, True]
        else:
            assert "return_routed_experts" in str(generated["error"]), (version, generated)
            assert launched is not None, version
