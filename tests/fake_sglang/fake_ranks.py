"""The fake SGLang server's tensor-parallel ranks: separate processes, as SGLang's schedulers.

Each joins the weight-update group exactly like SGLang's `init_custom_process_group` (tcp
rendezvous, `PrefixStore(group_name)`, torch's group helper) and receives buckets like SGLang's
model runner: per tensor, or one unpadded uint8 `flattened_bucket` sliced per tensor and viewed
as its dtype; it answers with the sha256 of every tensor it received.
"""

from __future__ import annotations

import datetime
import hashlib


def _join(args: dict, tp_rank: int):
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world, rendezvous

    timeout = datetime.timedelta(seconds=30)
    if args.get("backend", "nccl") == "nccl":  # a GPU per TP rank, as SGLang's schedulers
        import torch

        torch.cuda.set_device(tp_rank)
    rank = args["rank_offset"] + tp_rank
    url = f"tcp://{args['master_address']}:{args['master_port']}"
    store, _, _ = next(rendezvous(url, rank, args["world_size"], timeout=timeout))
    store.set_timeout(timeout)
    name = args.get("group_name", "weight_update_group")
    pg, _ = _new_process_group_helper(
        args["world_size"], rank, [], dist.Backend(args.get("backend", "nccl")),
        dist.PrefixStore(name, store), group_name=name, timeout=timeout,
    )  # fmt: skip
    _world.pg_group_ranks[pg] = {i: i for i in range(args["world_size"])}
    return pg


def _receive(pg, body: dict, device: str) -> dict[str, str]:
    import torch
    import torch.distributed as dist

    def bcast(t):
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        return pg.broadcast([t], opts)

    empties = [
        torch.empty(s, dtype=getattr(torch, d), device=device)
        for d, s in zip(body["dtypes"], body["shapes"])
    ]
    if body.get("load_format") == "flattened_bucket":
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in empties])  # unpadded, in order
        bcast(flat).wait()
        tensors, start = [], 0
        for t in empties:
            n = t.numel() * t.element_size()
            tensors.append(flat[start : start + n].view(t.dtype).reshape(t.shape))
            start += n
    else:
        works = [bcast(t) for t in empties]
        for w in works:
            w.wait()
        tensors = empties
    return {
        name: hashlib.sha256(t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
        for name, t in zip(body["names"], tensors)
    }


def rank_worker(conn, tp_rank: int) -> None:
    groups: dict = {}  # group name -> (process group, receive device)
    while True:
        cmd, args = conn.recv()
        name = args.get("group_name", "weight_update_group") if isinstance(args, dict) else None
        try:
            if cmd == "init":
                device = f"cuda:{tp_rank}" if args.get("backend", "nccl") == "nccl" else "cpu"
                groups[name] = (_join(args, tp_rank), device)
                conn.send(("ok", None))
            elif cmd == "update":
                pg, device = groups[name]
                conn.send(("ok", _receive(pg, args, device)))
            elif cmd == "destroy":
                entry = groups.pop(name, None)
                if entry is not None:  # as SGLang's model runner does
                    import torch.distributed as dist

                    dist.destroy_process_group(entry[0])
                conn.send(("ok", None))
            else:
                return
        except Exception as e:  # noqa: BLE001 - reported to the HTTP process as SGLang would
            conn.send(("error", f"{type(e).__name__}: {e}"))
