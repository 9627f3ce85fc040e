"""The EP LL 'basic' cases of tests/gpu/test_ep_cuda.py at one world size (default 8) through the
test suite's rank pool, printing every rank's error in full. Run from tests/."""
import sys

sys.path[:0] = ["gpu", "."]

if __name__ == "__main__":
    from conftest import RankPool
    import test_ep_cuda as m
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    pool = RankPool(world, env=m.LL)
    try:
        pool.run(m._dispatch_combine, "basic", timeout=200)
        print(f"LL basic world {world}: passed")
    except Exception as e:  # noqa: BLE001
        print(f"LL basic world {world}: {type(e).__name__}: {e}"[:6000])
        for r, (kind, text) in sorted(getattr(e, "errors", {}).items()):
            print(f"--- rank {r}: {kind}\n{text[-3000:]}")
