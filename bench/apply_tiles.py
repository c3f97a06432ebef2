"""Write a sweep's winners into a copy of engine/kernels/quant_tiles.py: the tree an A/B of the whole model runs
against the committed tables (`bash bench/gpu_check.sh sweep-ab`), and the table to commit when it wins.

    python -m bench.apply_tiles SWEEP.jsonl PATH/quant_tiles.py
    python -m bench.apply_tiles --l2-ahead 4 PATH/quant_tiles.py  # GEMV_TABLE's tiles, prefetching into L2

SWEEP.jsonl holds the rows `python -m bench.quant_gpu --sweep gemv / mid` writes: each shape's row names its
fastest tiles, keyed as GEMV_TABLE ((bits, K, N), sweep "gemv-w{bits}", "best") or MID_TABLE ((bits, K, N,
rows), sweep "mid-w{bits}", "best": fragment-layout tiles too, WeightOnlyLinear keeping a copy of the weight
in each layout the table names). Entries the sweep did not reach keep
their tiles; the tables are rewritten one entry a line (ruff format reflows them).
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

from engine.kernels.quant_tiles import GemvTiles, MidTiles

_TABLES = {"gemv": ("GEMV_TABLE", GemvTiles), "mid": ("MID_TABLE", MidTiles)}


def winners(rows: list[dict]) -> dict[str, dict[tuple, object]]:
    """Table name -> {key: tiles} of the sweep's rows (the last row of a key wins)."""
    found: dict[str, dict[tuple, object]] = {name: {} for name, _ in _TABLES.values()}
    for row in rows:
        kind = row.get("sweep", "").split("-w")[0]
        if kind not in _TABLES or "best" not in row:
            continue
        name, cls = _TABLES[kind]
        bits = int(row["sweep"].rsplit("-w", 1)[1])
        key = (bits, row["k"], row["n"]) if kind == "gemv" else (bits, row["k"], row["n"], row["m"])
        found[name][key] = eval(row["best"], {cls.__name__: cls})  # the repr bench.quant_gpu wrote
    return found


def l2_tables(ahead: int) -> dict[str, dict[tuple, object]]:
    """GEMV_TABLE's entries, each prefetching `ahead` steps into L2 (GemvTiles.l2_ahead; unpipelined, as the
    prefetch takes), as winners() returns them: the tree `bash bench/gpu_check.sh l2-ab` times."""
    from dataclasses import replace

    from engine.kernels.quant_tiles import GEMV_TABLE

    gemv = {key: replace(t, num_stages=1, l2_ahead=ahead) for key, t in GEMV_TABLE.items()}
    return {"GEMV_TABLE": gemv, "MID_TABLE": {}}


def apply(source: str, tables: dict[str, dict[tuple, object]]) -> str:
    """source (quant_tiles.py) with each named table's entries updated from `tables`, others unchanged."""
    lines = source.splitlines(keepends=True)
    edits = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in tables:
            new = tables[node.target.id]
            if not new:
                continue
            value = node.value
            current = eval(
                compile(ast.Expression(value), "<table>", "eval"), {"GemvTiles": GemvTiles, "MidTiles": MidTiles}
            )
            current.update(new)
            body = "".join(f"    {key!r}: {tiles!r},\n" for key, tiles in current.items())
            edits.append((value.lineno, value.end_lineno, value.col_offset, "{\n" + body + "}\n"))
    for start, end, col, text in sorted(edits, reverse=True):
        lines[start - 1 : end] = [lines[start - 1][:col] + text]
    return "".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", type=Path, nargs="?", help="the sweep's rows (not with --l2-ahead)")
    parser.add_argument("tiles", type=Path, help="a copy of engine/kernels/quant_tiles.py, rewritten in place")
    parser.add_argument("--l2-ahead", type=int, default=None, help="GEMV_TABLE's entries with this l2_ahead")
    args = parser.parse_args()
    if (args.l2_ahead is None) == (args.sweep is None):
        parser.error("name either a sweep's rows or --l2-ahead")
    if args.l2_ahead is not None:
        tables = l2_tables(args.l2_ahead)
    else:
        tables = winners([json.loads(line) for line in args.sweep.read_text().splitlines() if line.strip()])
    args.tiles.write_text(apply(args.tiles.read_text(), tables))
    for name, entries in tables.items():
        for key, tiles in entries.items():
            print(f"{name}[{key}] = {tiles!r}")


if __name__ == "__main__":
    main()
