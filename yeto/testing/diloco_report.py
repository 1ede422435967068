"""The report of `scripts/compare_diloco.py`: each arm's rows over seeds, their ratios to
the synchronous reference, the tables (terminal or markdown) and the RESULT lines with
each goal's verdict. Pure: it reads results, runs nothing."""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from yeto.display import markdown_table, table_text
from yeto.testing.diloco_arms import (
    CANDIDATES,
    CELLS,
    REAL_CELLS,
    Arm,
    Regime,
    candidate_of,
    cell_of,
)


@dataclass
class Row:
    arm: Arm
    results: dict[int, dict] = field(default_factory=dict)  # seed -> result
    ratios: dict[int, float] = field(default_factory=dict)

    def mean(self, key: str) -> float:
        vals = [r[key] for r in self.results.values()]
        return statistics.fmean(vals) if vals else math.nan


def attach_ratios(rows: dict[str, Row]) -> None:
    """Each arm's ratio to its reference arm, per seed both ran; a seed whose reference
    ended unstable (`spiked`) has no ratio (the report says which)."""
    for row in rows.values():
        ref = rows.get(f"{row.arm.regime}:{row.arm.ref}") if row.arm.ref else None
        for seed, r in row.results.items():
            if ref is not None and seed in ref.results and not spiked(ref.results[seed]):
                row.ratios[seed] = r["eval_loss"] / ref.results[seed]["eval_loss"]


SPIKE = 0.05  # a final held-out loss this far above the run's own best: a spike


def spiked(res: dict) -> bool:
    """Whether a run's final held-out loss is more than SPIKE above the best it reached
    along the way (its curve): a reference that blew up at the end measures nothing."""
    best = min((x for _, x in res.get("curve", [])), default=None)
    return best is not None and res["eval_loss"] > best * (1 + SPIKE)


def spike_lines(rows: dict[str, Row]) -> list[str]:
    """The reference runs left out of the ratios as `spiked`."""
    refs = {f"{r.arm.regime}:{r.arm.ref}" for r in rows.values() if r.arm.ref}
    return [f"RESULT note=reference_spiked arm={key} seed={seed} eval_loss={res['eval_loss']:.4f} "
            f"best_on_the_way={min(x for _, x in res['curve']):.4f} (no ratio for this seed)"
            for key in sorted(refs & set(rows)) for seed, res in sorted(rows[key].results.items())
            if spiked(res)]


def fmt_bytes(b: float) -> str:
    if b <= 0:
        return "0"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"


# the numeric columns of the tables (right-aligned)
RIGHT_COLUMNS = (1, 2, 6, 7, 8, 10, 11, 12, 13, 14)


def print_tables(rows: dict[str, Row], regimes: dict[str, Regime], md: bool = False) -> None:
    headers = ["arm", "k", "H", "wire/down", "outer", "steps x b", "eval", "+-", "ratio", "vs",
               "up", "down", "B/tok vs AR", "x fewer", "wall s"]
    for name, rg in regimes.items():
        body = []
        for row in rows.values():
            a = row.arm
            if a.regime != name or not row.results:
                continue
            ev = [r["eval_loss"] for r in row.results.values()]
            bpt = row.mean("bytes_per_token_ratio")
            ratio = statistics.fmean(row.ratios.values()) if row.ratios else math.nan
            steps = "/".join(str(s) for s in a.island_steps) if a.island_steps else str(a.steps)
            outer = (f"{a.merge} {_rule(a)}{a.outer_lr:g}/{a.outer_momentum:g}"
                     if a.kind in ("diloco", "mixed") else "-")
            body.append([
                a.name, a.k, a.H or "-",
                f"{a.wire}/{a.downlink}" if a.kind in ("diloco", "mixed") else "-",
                outer, f"{steps} x {a.batch}", f"{statistics.fmean(ev):.4f}",
                f"{(max(ev) - min(ev)) / 2:.4f}", "-" if math.isnan(ratio) else f"{ratio:.4f}",
                a.ref or "-", fmt_bytes(row.mean("bytes_up")), fmt_bytes(row.mean("bytes_down")),
                f"{bpt:.2e}" if bpt else "-",
                f"{1 / bpt:,.0f}" if bpt else "-", f"{row.mean('wall_s'):.0f}"])
        if not body:
            continue
        seeds = sorted({s for r in rows.values() for s in r.results})
        first = next(iter(r for r in rows.values() if r.arm.regime == name and r.results))
        before = statistics.fmean(r["eval_loss_before"] for r in first.results.values())
        params = first.results[seeds[0]]["params"] if seeds[0] in first.results else "?"
        base = (f"base {Path(rg.base).name}" if rg.base
                else "pretrained base" if rg.pretrain else "from scratch")
        print(f"\n== regime {name}: tuning {rg.tuning}, {base}, data {rg.data}, "
              f"budget {rg.steps} x {rg.batch} x {rg.seq_len} tokens, inner lr {rg.inner_lr:g}, "
              f"{params} trainable params, held-out loss before {before:.4f}, "
              f"seeds {','.join(map(str, seeds))}")
        print(markdown_table(headers, body) if md else
              table_text(headers, body, right=RIGHT_COLUMNS))


def _rule(a: Arm) -> str:
    return "" if a.outer == "nesterov" else a.outer.removeprefix("nesterov-") + " "


def print_grids(rows: dict[str, Row], md: bool = False) -> None:
    """The outer optimizer grid (H = 50, q4 both ways, mean merge) per regime and k:
    the ratio to dp<k> ± half its range over seeds, outer lr by momentum."""
    lrs, moms = (0.4, 0.7, 1.0), (0.0, 0.5, 0.9)
    for regime, k in itertools.product(("warm", "scratch"), (1, 2, 4, 8)):
        cells = {(r.arm.outer_lr, r.arm.outer_momentum): r
                 for r in _h50_arms(rows, regime, k) if r.arm.wire == r.arm.downlink == "q4"}
        if len(cells) < 4:
            continue
        ref = "single" if k == 1 else f"dp{k}"
        _print_cross(f"outer grid, {regime}, k = {k}, H = 50, q4/q4: ratio to {ref}",
                     "outer lr \\ momentum", lrs, moms, cells, md)


def print_wires(rows: dict[str, Row], md: bool = False) -> None:
    """The wire cross (k = 4, H = 50, outer Nesterov 0.7/0.9) per regime: uplink by
    downlink, the ratio to dp4 ± half its range over seeds."""
    for regime in ("warm", "scratch"):
        cells = {(r.arm.wire, r.arm.downlink): r for r in _h50_arms(rows, regime, 4)
                 if (r.arm.outer_lr, r.arm.outer_momentum) == (0.7, 0.9)}
        if len(cells) >= 4:
            _print_cross(f"wire, {regime}, k = 4, H = 50, outer 0.7/0.9: ratio to dp4",
                         "up \\ down", ("f32", "bf16", "q4"), ("f32", "q4"), cells, md)


def _h50_arms(rows: dict[str, Row], regime: str, k: int) -> list[Row]:
    """The measured DiLoCo arms of a regime at k islands, H = 50, mean merge, no extra
    syncer flags: the arms the cross tables compare."""
    return [r for r in rows.values()
            if r.arm.regime == regime and r.arm.kind == "diloco" and r.arm.k == k
            and r.arm.H == 50 and r.arm.merge == "mean" and not r.arm.syncer_extra
            and r.arm.outer == "nesterov"
            and r.ratios]


def _print_cross(title: str, corner: str, row_keys, col_keys, cells: dict, md: bool) -> None:
    body = [[f"{r:g}" if isinstance(r, float) else r,
             *[_grid_cell(cells.get((r, c))) for c in col_keys]] for r in row_keys]
    headers = [corner, *[f"{c:g}" if isinstance(c, float) else c for c in col_keys]]
    print(f"\n== {title} ± half the range (seeds)")
    print(markdown_table(headers, body) if md else table_text(headers, body))


def _grid_cell(r: Row | None) -> str:
    if r is None:
        return "-"
    v = list(r.ratios.values())
    return f"{statistics.fmean(v):.4f} ± {(max(v) - min(v)) / 2:.4f} ({len(v)})"


def result_lines(rows: dict[str, Row]) -> list[str]:
    out = []
    for row in rows.values():
        for seed, r in sorted(row.results.items()):
            out.append(_result(row.arm, seed, r["eval_loss"], row.ratios.get(seed, math.nan),
                               r["bytes_up"], r["bytes_down"], r["bytes_per_token_ratio"]))
        if len(row.results) > 1:
            ratio = statistics.fmean(row.ratios.values()) if row.ratios else math.nan
            out.append(_result(row.arm, "mean", row.mean("eval_loss"), ratio,
                               row.mean("bytes_up"), row.mean("bytes_down"),
                               row.mean("bytes_per_token_ratio")))
    return out


def _result(arm: Arm, seed, loss, ratio, up, down, bpt) -> str:
    return (f"RESULT arm={arm.key} seed={seed} eval_loss={loss:.5f} ratio={_n(ratio)} "
            f"bytes_up={int(up)} bytes_down={int(down)} bytes_per_token_ratio={_n(bpt)}")


def _n(x: float) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.5g}"


def goal_lines(rows: dict[str, Row]) -> list[str]:
    """The default mode's goals: DiLoCo k = 4 against dp4 and its bytes, q4 against f32,
    and the DiLoCo paper's Table 2 from scratch."""
    return _diloco4_goal_lines(rows) + _q4_goal_lines(rows) + _table2_goal_lines(rows)


def _done(rows: dict[str, Row], key: str) -> Row | None:
    r = rows.get(key)
    return r if r is not None and r.results else None


def _diloco4_goal_lines(rows: dict[str, Row]) -> list[str]:
    """k=4, q4, H >= 50: eval <= 1.01 x dp4 at >= 500x fewer bytes per token."""
    out = []
    for regime in sorted({r.arm.regime for r in rows.values()}):
        cands = [r for r in rows.values() if r.results and r.arm.kind == "diloco"
                 and r.arm.k == 4 and r.arm.wire == "q4" and r.arm.H >= 50 and r.ratios
                 and r.arm.regime == regime and r.arm.ref == "dp4"]
        best = None
        for r in cands:
            ratio = statistics.fmean(r.ratios.values())
            fewer = 1 / r.mean("bytes_per_token_ratio")
            ok = ratio <= 1.01 and fewer >= 500
            if best is None or (ok, -ratio) > (best[0], -best[1]):
                best = (ok, ratio, fewer, r.arm.key)
            out.append(f"RESULT goal=diloco4_q4_H50 arm={r.arm.key} met={'yes' if ok else 'no'} "
                       f"ratio={ratio:.4f} fewer_bytes={fewer:.0f} seeds={len(r.ratios)}")
        if best is not None:
            out.append(f"RESULT goal=diloco4_q4_H50 regime={regime} met="
                       f"{'yes' if best[0] else 'no'} best={best[3]} ratio={best[1]:.4f} "
                       f"fewer_bytes={best[2]:.0f} target_ratio=1.01 target_fewer=500")
    if not any(x.startswith("RESULT goal=diloco4_q4_H50 regime=") for x in out):
        out.append("RESULT goal=diloco4_q4_H50 met=n/a reason=no_arm_ran")
    return out


def _q4_goal_lines(rows: dict[str, Row]) -> list[str]:
    """q4 within 0.3% of f32: the uplink (q4 pushes against f32 pushes, f32 downlink)
    and, reported beside it, the downlink (q4 broadcasts against f32 broadcasts)."""
    out: list[str] = []
    worst: dict[str, tuple] = {}
    for r in rows.values():
        a = r.arm
        if a.kind != "diloco" or a.wire != "q4" or not r.results:
            continue
        pair = None
        if a.name.endswith("-q4"):
            pair = ("up", _done(rows, f"{a.regime}:{a.name[:-3]}-f32"))
        elif a.name.endswith("-dq4"):
            pair = ("down", _done(rows, f"{a.regime}:{a.name[:-4]}"))
        if pair is None or pair[1] is None:
            continue
        link, f = pair
        seeds = sorted(set(r.results) & set(f.results))
        if not seeds:
            continue
        diffs = [r.results[s]["eval_loss"] / f.results[s]["eval_loss"] - 1 for s in seeds]
        d = statistics.fmean(diffs)
        se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan
        ok = d <= 0.003
        out.append(f"RESULT goal=q4_vs_f32 link={link} q4={a.key} f32={f.arm.key} "
                   f"met={'yes' if ok else 'no'} diff_pct={100 * d:+.3f} "
                   f"se_pct={100 * se:.3f} seeds={len(seeds)}")
        if link not in worst or d > worst[link][0]:
            worst[link] = (d, a.key)
    if "up" in worst:
        d, key = worst["up"]
        out.append(f"RESULT goal=q4_vs_f32 met={'yes' if d <= 0.003 else 'no'} worst={key} "
                   f"diff_pct={100 * d:+.3f} target_pct=0.3")
    else:
        out.append("RESULT goal=q4_vs_f32 met=n/a reason=no_pair_ran")
    if "down" in worst:
        d, key = worst["down"]
        out.append(f"RESULT goal=q4_downlink met={'yes' if d <= 0.003 else 'no'} worst={key} "
                   f"diff_pct={100 * d:+.3f} target_pct=0.3")
    return out


def _table2_goal_lines(rows: dict[str, Row]) -> list[str]:
    """From scratch: diloco4 <= dp4 < single (the paper's baseline: as many steps, 1/k
    of the tokens); the default arm, and the best k=4 DiLoCo arm."""
    out = []
    dp, single = _done(rows, "full:dp4"), _done(rows, "full:single")
    same = _done(rows, "full:single-same-tokens")
    dls = [r for r in rows.values() if r.results and r.arm.regime == "full"
           and r.arm.kind == "diloco" and r.arm.k == 4]
    if dp and single and dls:
        e_dp, e_single = dp.mean("eval_loss"), single.mean("eval_loss")
        extra = f" single_same_tokens={same.mean('eval_loss'):.4f}" if same else ""
        default = _done(rows, "full:diloco4-H50-q4")
        best = min(dls, key=lambda r: r.mean("eval_loss"))
        for tag, r in (("default", default), ("best", best)):
            if r is None:
                continue
            e = r.mean("eval_loss")
            ok = e <= e_dp < e_single
            out.append(f"RESULT goal=full_table2 arm={r.arm.key} which={tag} "
                       f"met={'yes' if ok else 'no'} diloco4={e:.4f} dp4={e_dp:.4f} "
                       f"single={e_single:.4f}{extra}")
        e = best.mean("eval_loss")
        out.append(f"RESULT goal=full_table2 met={'yes' if e <= e_dp < e_single else 'no'} "
                   f"best={best.arm.key} diloco4={e:.4f} dp4={e_dp:.4f} single={e_single:.4f}")
    else:
        out.append("RESULT goal=full_table2 met=n/a reason=arms_missing")
    return out


# ---------------------------------------------------------------- outer rules (--rules)

# each regime's goal: ratio to dp<k> at most, bytes per token fewer at least;
# a rule meets the goal when it meets the short and warm cells (scratch: reported)
RULE_TARGETS = {"short": (1.03, 0), "warm": (1.00, 400), "scratch": (1.00, 400),
                "warm2m": (1.00, 400), "real": (1.03, 0)}  # real: k = 2 and 4
REQUIRED = ("short", "warm")


def _rule_rows(rows: dict[str, Row]) -> dict[tuple, Row]:
    """(candidate, cell) -> its row, for the measured arms of the rules table."""
    out = {}
    for r in rows.values():
        cand, cell = candidate_of(r.arm), cell_of(r.arm)
        if cand and cell and r.ratios:
            out[(cand, cell)] = r
    return out


def _cell_name(cell: tuple) -> str:
    return f"{cell[0]}:k{cell[1]}:H{cell[2]}"


def print_rules(rows: dict[str, Row], md: bool, cells: tuple = CELLS) -> None:
    """Candidates by cells: the ratio to dp<k> ± half the range (seeds), "not run" where
    no seed ran; the bytes per token fewer than an all-reduce under each cell."""
    by = _rule_rows(rows)
    if not by:
        return
    cands = list(dict.fromkeys(c for c in CANDIDATES if any(k[0] == c for k in by)))
    body = [[f"{c} ({'/'.join(map(str, CANDIDATES[c]))})",
             *[_grid_cell(by[(c, cell)]) if (c, cell) in by else "not run" for cell in cells]]
            for c in cands]
    fewer = [next((f"{1 / r.mean('bytes_per_token_ratio'):,.0f}x" for (_, cl), r in by.items()
                   if cl == cell), "-") for cell in cells]
    body.append(["bytes fewer than all-reduce", *fewer])
    print("\n== outer rules: ratio to dp<k> ± half the range (seeds), q4 both ways")
    print(markdown_table(["rule (outer/lr/momentum)", *map(_cell_name, cells)], body) if md
          else table_text(["rule", *map(_cell_name, cells)], body))


def rules_goal_lines(rows: dict[str, Row], cells: tuple = CELLS,
                     required: tuple = REQUIRED) -> list[str]:
    """Per candidate and cell: its ratio, spread, bytes and goal; then per candidate
    whether it meets every required cell (no once one fails; n/a while one has no run)."""
    by, out = _rule_rows(rows), []
    for cand in CANDIDATES:
        verdicts = {}
        for cell in cells:
            r = by.get((cand, cell))
            if r is None:
                continue
            v = list(r.ratios.values())
            ratio, fewer = statistics.fmean(v), 1 / r.mean("bytes_per_token_ratio")
            at_most, at_least = RULE_TARGETS[cell[0]]
            verdicts[cell] = ok = ratio <= at_most and fewer >= at_least
            out.append(f"RESULT goal=outer_rule rule={cand} cell={_cell_name(cell)} "
                       f"met={'yes' if ok else 'no'} ratio={ratio:.4f}+-"
                       f"{(max(v) - min(v)) / 2:.4f} fewer_bytes={fewer:.0f} seeds={len(v)} "
                       f"target_ratio={at_most:g} target_fewer={at_least}")
        if not verdicts:
            continue
        missing = [_cell_name(c) for c in cells if c[0] in required and c not in verdicts]
        failed = any(not ok for c, ok in verdicts.items() if c[0] in required)
        met = "no" if failed else "n/a" if missing else "yes"
        out.append(f"RESULT goal=one_rule rule={cand} met={met} "
                   + (f"missing={','.join(missing)} " if missing else "")
                   + f"cells={len(verdicts)}/{len(cells)}")
    return out


def report(rows: dict[str, Row], regimes: dict[str, Regime], skipped: list[str],
           md: bool) -> None:
    attach_ratios(rows)
    print_tables(rows, regimes, md)
    print_grids(rows, md)
    print_wires(rows, md)
    for r in rows.values():
        if r.arm.kind != "mixed":
            continue
        for seed, res in sorted(r.results.items()):
            print(f"{r.arm.key} seed {seed}: steps {res['steps']}, wall {res['wall_s']}s, "
                  f"waiting for rounds {res.get('wait_s', '?')}s, "
                  f"tape tokens {res.get('tape_tokens')}, mean share "
                  f"{ {k: round(v, 3) for k, v in res.get('share_mean', {}).items()} }")
    for s in skipped:
        print(f"skipped: {s}")
    print()
    long_mode = any(rg.name in ("warm", "scratch") for rg in regimes.values())
    if "short" in regimes:  # --rules, --quick
        print_rules(rows, md)
        goals = spike_lines(rows) + rules_goal_lines(rows)
    elif "real" in regimes:  # --real
        print_rules(rows, md, REAL_CELLS)
        goals = spike_lines(rows) + rules_goal_lines(rows, REAL_CELLS, ("real",))
    else:
        goals = long_goal_lines(rows) if long_mode else goal_lines(rows)
    for line in result_lines(rows) + goals:
        print(line)


def long_goal_lines(rows: dict[str, Row]) -> list[str]:
    """The long regime's goals: k=4 H=50 q4/q4 <= 1.00 x dp4 at >= 400x
    fewer bytes per token; q4 within 0.3 % of f32; loss falls with k."""
    out = []
    for regime in ("warm", "scratch"):  # every k = 4, H >= 50, q4 both ways arm
        for r in rows.values():
            a = r.arm
            if (a.regime != regime or a.kind != "diloco" or a.k != 4 or a.H < 50
                    or a.wire != "q4" or a.downlink != "q4" or not r.ratios):
                continue
            ratio, fewer = statistics.fmean(r.ratios.values()), 1 / r.mean("bytes_per_token_ratio")
            spread = (max(r.ratios.values()) - min(r.ratios.values())) / 2
            out.append(f"RESULT goal=long_diloco4_vs_dp4 arm={a.key} "
                       f"met={'yes' if ratio <= 1.0 and fewer >= 400 else 'no'} "
                       f"ratio={ratio:.4f}+-{spread:.4f} fewer_bytes={fewer:.0f} "
                       f"seeds={len(r.ratios)}")
    # q4 both ways, and q4 up with f32 down (the default wire), against f32 both ways
    for regime, H, wire in itertools.product(("warm", "scratch"), (50, 100), ("q4/q4", "q4/f32")):
        q4 = rows.get(f"{regime}:diloco4-H{H}-{'q4-dq4' if wire == 'q4/q4' else 'q4'}-nest")
        f32 = rows.get(f"{regime}:diloco4-H{H}-f32-nest")
        seeds = sorted(set(q4.results) & set(f32.results)) if q4 and f32 else []
        if seeds:  # over the seeds both ran
            gap = (statistics.fmean(q4.results[s]["eval_loss"] for s in seeds)
                   / statistics.fmean(f32.results[s]["eval_loss"] for s in seeds) - 1)
            out.append(f"RESULT goal=long_q4_vs_f32 arm={regime}:H{H} wire={wire} "
                       f"met={'yes' if abs(gap) <= 0.003 else 'no'} gap={100 * gap:+.2f}% "
                       f"seeds={len(seeds)}")
    # at a fixed budget per island; warm with Nesterov 0.7/0.9, from scratch with plain
    # averaging (each regime's sweep runs its better rule)
    for regime, suffix in (("warm", "-dq4-nest"), ("scratch", "-dq4")):
        ks = [(k, rows.get(f"{regime}:diloco{k}-H50-q4{suffix}")) for k in (1, 2, 4, 8)]
        losses = [(k, r.mean("eval_loss")) for k, r in ks if r is not None and r.results]
        if len(losses) >= 2:
            falls = all(b[1] < a[1] for a, b in zip(losses, losses[1:]))
            out.append(f"RESULT goal=long_loss_falls_with_k regime={regime} "
                       f"met={'yes' if falls else 'no'} "
                       + " ".join(f"k{k}={v:.4f}" for k, v in losses))
    return out
