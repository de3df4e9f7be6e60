"""The lazy K/V kernel (``kernels/lazy_kv.py``) timed on a GPU, tile by tile, against the dense
K/V projection that it replaces (cuBLAS, the two weights stacked), on OPT-13B's attention shape
(d 5120, 40 heads of 128, a 256-position cache, position 200, heads 0.5).

Scenarios: ``steady``, each selected head was selected at the step before (only the new position
is computed); ``missing1`` to ``missing100``, half the selected heads were not selected for the
last 1, 3, 20 or 100 steps (those positions are zero and are filled in). For the missing
scenarios, each timed launch follows a restore of the zeros and valid prefixes (timed alone and
subtracted). Prints us a launch and GB/s on the selected heads' weight bytes, fastest first:

    python examples/lazy_kv_study.py            # needs a CUDA GPU
"""
import argparse

import torch
from dejavu_compile.kernels import kv_state, lazy_kv

D, H, HD, L, POS = 5120, 40, 128, 256, 200


def _graph_time(fn, reps: int = 50) -> float:
    """us per call of ``fn``, replayed from a CUDA graph of ``reps`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / reps)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--density", type=float, default=0.5)
    args = parser.parse_args()
    torch.manual_seed(0)
    dev, dt = "cuda", torch.float16
    wk = torch.randn(H * HD, D, device=dev, dtype=dt) * 0.02
    wv = torch.randn(H * HD, D, device=dev, dtype=dt) * 0.02
    bk, bv = torch.randn(H * HD, device=dev, dtype=dt), torch.randn(H * HD, device=dev, dtype=dt)
    wkv = torch.cat([wk, wv])
    bkv = torch.cat([bk, bv])
    x = torch.randn(1, 1, D, device=dev, dtype=dt)
    keys = torch.randn(1, H, L, HD, device=dev, dtype=dt)
    values = torch.randn(1, H, L, HD, device=dev, dtype=dt)
    pos = torch.tensor([POS], device=dev)
    k = round(args.density * H)
    chosen = torch.randperm(H, device=dev)[:k]
    idx = chosen.view(1, 1, k)
    state = kv_state.lazy_state(keys, D, dt)
    sel_bytes = 2 * k * HD * D * 2
    dense = _graph_time(lambda: torch.nn.functional.linear(x, wkv, bkv))
    print(f"cuBLAS dense K/V: {dense:.1f} us, {2 * H * HD * D * 2 / dense / 1e3:.0f} GB/s")
    names = ("BLOCK_P", "DOT", "BLOCK_C", "BLOCK_K", "num_warps", "num_stages", "SPLIT")
    tiles = [(1, False, 16, 128, 4, 3), (1, False, 32, 128, 4, 3), (1, False, 16, 256, 4, 3),
             (1, False, 8, 256, 2, 3), (1, False, 16, 512, 4, 2), (2, False, 16, 128, 4, 3),
             (4, False, 16, 64, 4, 3), (4, False, 16, 128, 4, 3), (4, False, 32, 64, 4, 3),
             (16, True, 16, 128, 4, 3), (16, True, 32, 128, 4, 3), (16, True, 32, 256, 8, 3),
             # d split over programs (the last of a position tile stores the rows)
             (1, False, 32, 128, 4, 3, 8), (1, False, 16, 128, 4, 3, 8),
             (1, False, 32, 128, 4, 3, 4), (1, False, 16, 64, 4, 3, 16),
             (4, False, 16, 128, 4, 3, 8), (16, True, 32, 128, 4, 3, 8),
             (16, True, 32, 64, 4, 3, 8), (16, True, 16, 128, 4, 3, 16),
             (32, True, 32, 64, 4, 3, 8), (64, True, 32, 64, 8, 3, 8),
             (16, True, 64, 64, 4, 3, 8), (16, True, 64, 128, 4, 3, 8),
             (16, True, 128, 64, 8, 3, 8), (16, True, 64, 64, 4, 3, 16),
             (16, True, 128, 64, 8, 3, 16), (16, True, 32, 64, 4, 4, 16)]
    configs = [dict(zip(names, t if len(t) == 7 else (*t, 1), strict=True)) for t in tiles]
    rows = []
    scenarios = (("steady", 0), ("missing1", 1), ("missing3", 3), ("missing20", 20),
                 ("missing100", 100))
    for scenario, gap in scenarios:
        behind = chosen[: k // 2]
        valid0 = torch.full((1, H), POS, dtype=torch.int32, device=dev)
        valid0[0, behind] = POS - gap

        def restore(behind=behind, gap=gap, valid0=valid0):
            if gap:  # index_fill_ on the GPU: a capture cannot copy a CPU scalar in
                for cache in (keys, values):
                    cache[0, :, POS - gap:POS].index_fill_(0, behind, 0.0)
            state.valid.copy_(valid0)

        base = _graph_time(restore)
        for cfg in configs:
            def run(cfg=cfg, restore=restore):
                restore()
                lazy_kv.lazy_kv(x, idx, wk, bk, wv, bv, keys, values, pos, config=cfg)
            try:
                t = _graph_time(run) - base
            except Exception as e:  # a config this GPU cannot compile
                print(scenario, cfg, "failed:", str(e).splitlines()[0][:120])
                continue
            rows.append((scenario, t, cfg))
    for scenario, _ in scenarios:
        print(f"\n{scenario} (selected weights {sel_bytes / 1e6:.1f} MB):")
        for _, t, cfg in sorted((r for r in rows if r[0] == scenario), key=lambda r: r[1]):
            print(f"  {t:6.1f} us  {sel_bytes / t / 1e3:5.0f} GB/s  {cfg}")


if __name__ == "__main__":
    main()
