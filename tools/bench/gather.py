"""`kvtier bench gather` (also `python -m kvtier.tools.bench.gather`): the paged-KV save and
load paths against the copy ceiling. The measurement builds device tensors, so it lives in
`kvtier.connector.harness.gather_bench` (connector/ is the only package that touches them); this is
its command-line entry. Needs only torch, numpy and xxhash (no vLLM)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    from kvtier.connector.harness.gather_bench import main as run
    run(argv)


if __name__ == "__main__":
    main()
