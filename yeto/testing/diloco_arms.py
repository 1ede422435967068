"""The arms of `scripts/compare_diloco.py` as data: each regime (what is trained, on
what, for how long) and each arm (k islands, H, wire, outer rule), and which arms each
mode runs (`plan`), what an arm's cached result depends on (`config_of`), and the
`--arms` / `--max-steps` selections. The runner and its cache live in
scripts/compare_diloco.py; the tables and RESULT lines in `yeto.testing.diloco_report`.

Mode `--rules` crosses the outer-rule candidates (`CANDIDATES`, each a
`syncer.strategy` rule with its lr and momentum) with three regimes, q4 both ways, each
cell's ratio to data-parallel on the same tokens:
  short    LoRA SFT on the synthetic chat task, k = 4, H = 50: 8 rounds (400 steps per
           island), the regime where outer momentum lost (dp4: one island, 4x batch)
  warm     full weights on stdlib source from the briefly pretrained tiny base, 5000
           steps per island, k = 4 and 8 at H = 100 (50 rounds; the bytes goal, >= 400x
           fewer than an all-reduce, needs H = 100 at k = 4)
  scratch  the same from random init, k = 4, H = 50 (100 rounds) and H = 100
  warm2m   warm on the "small" tiny model (`yeto.testing.tiny.MODEL_SIZES`, over 2M
           parameters), k = 4, H = 100, for dp4 and `LARGER_RULES` only: does the ratio
           hold as the model grows (run it with --seeds 0,1)
DiLoCo arms run through `python -m yeto.sim` (one process per arm), dp arms as one
island process.

Mode `--real` runs `REAL_CELLS`: LoRA (rank 16, the default targets) on a real
pretrained model (SmolLM2-135M-Instruct from its GGUF file, `yeto.testing.real.SMOLLM2`,
or --model) and real text (standard-library docstrings, `yeto.testing.real.stdlib_docs`),
k = 2 and 4 islands, 4 rounds each, the default rule and plain averaging (`REAL_RULES`),
each against dp<k> on the same tokens, through `python -m yeto.sim` as well.
"""

from __future__ import annotations

import fnmatch
import itertools
from dataclasses import asdict, dataclass, replace

DATA_VERSION = 1  # bump when the prepared data change


@dataclass(frozen=True)
class Regime:
    name: str              # "lora" or "full"
    tuning: str            # learner --tuning
    pretrain: bool         # tiny base pretrained (LoRA SFT) or random init (from scratch)
    data: str              # "task" (synthetic chat) or "stdlib" (Python source text)
    steps: int             # N: single-island steps of the token budget
    batch: int             # b: blocks per island step
    seq_len: int
    inner_lr: float
    lora_r: int = 16
    sim: bool = False      # DiLoCo arms through python -m yeto.sim (one process)
    eval_blocks: int = 0   # held-out blocks evaluated (0 = all); islands evaluate at syncs
    size: str = "tiny"     # the tiny model's size (yeto.testing.tiny.MODEL_SIZES)
    base: str = ""         # a real base instead (a GGUF file or a model dir); "" = tiny


@dataclass(frozen=True)
class Arm:
    regime: str
    name: str
    kind: str              # single | dp | diloco | nomerge | mixed
    k: int = 1
    steps: int = 0         # per island
    batch: int = 0         # per island step
    H: int = 0
    wire: str = "q4"
    outer_lr: float = 1.0  # plain averaging; see NESTEROV
    outer_momentum: float = 0.0
    outer: str = "nesterov"  # the syncer's --outer (syncer.strategy.OPTIMIZERS)
    merge: str = "mean"
    downlink: str = "f32"
    extra: tuple[str, ...] = ()          # flags for every island
    syncer_extra: tuple[str, ...] = ()   # flags for the syncer (e.g. --fragments P)
    per_island: tuple[tuple[str, ...], ...] = ()  # extra flags per island
    island_steps: tuple[int, ...] = ()    # max-steps per island (mixed arms)
    ref: str | None = None  # synchronous reference arm (same regime) for `ratio`

    @property
    def key(self) -> str:
        return f"{self.regime}:{self.name}"

    def steps_of(self, i: int) -> int:
        return self.island_steps[i] if self.island_steps else self.steps


def diloco(rg: Regime, k: int, H: int, wire: str = "q4", *, suffix: str = "",
           **kw) -> Arm:
    return Arm(rg.name, f"diloco{k}-H{H}-{wire}{suffix}", "diloco", k=k, steps=rg.steps // k,
               batch=rg.batch, H=H, wire=wire, ref=f"dp{k}", **kw)


NESTEROV = dict(outer_lr=0.7, outer_momentum=0.9)  # the DiLoCo paper's outer step


def lora_arms(rg: Regime) -> list[Arm]:
    single = Arm(rg.name, "single", "single", steps=rg.steps, batch=rg.batch, ref="dp4")
    dp = [Arm(rg.name, f"dp{k}", "dp", k=k, steps=rg.steps // k, batch=rg.batch * k,
              ref=f"dp{k}") for k in (2, 4)]
    base = diloco(rg, 4, 50)
    h10 = diloco(rg, 4, 10)
    h100 = diloco(rg, 4, 100)
    blocking = ("--blocking-sync",)
    frozen = dict(extra=("--lora-freeze-a",))
    arms = [single, *dp]
    arms += [diloco(rg, k, H, w) for k in (2, 4) for H in (10, 50) for w in ("f32", "q4")]
    arms += [Arm(rg.name, f"nomerge{k}", "nomerge", k=k, steps=rg.steps // k, batch=rg.batch,
                 ref=f"dp{k}") for k in (2, 4)]
    arms += [
        # outer rules (the grid above averages: outer lr 1, momentum 0)
        replace(base, name=base.name + "-nest", **NESTEROV),
        replace(h10, name=h10.name + "-nest", **NESTEROV),
        replace(base, name=base.name + "-rda", merge="rda"),
        replace(base, name=base.name + "-rda-nest", merge="rda", **NESTEROV),
        replace(base, name=base.name + "-m05", outer_lr=0.7, outer_momentum=0.5),
        replace(base, name=base.name + "-o04", outer_lr=0.4, outer_momentum=0.9),
        # downlink, longer H
        replace(base, name=base.name + "-dq4", downlink="q4"),
        h100, replace(h100, name=h100.name + "-dq4", downlink="q4"),
        # LoRA merge mode: A frozen from the shared seed, only B trained and sent
        # (dp4-frozenA: the synchronous arm with A frozen too, so the capacity lost by
        # freezing A is told apart from what the merge loses)
        replace(dp[1], name="dp4-frozenA", ref="dp4", **frozen),
        replace(base, name=base.name + "-frozenA", **frozen),
        replace(base, name=base.name + "-frozenA-nest", **frozen, **NESTEROV),
        replace(h100, name=h100.name + "-dq4-frozenA", downlink="q4", **frozen),
        # Streaming DiLoCo: P fragments in turn, the same total bytes, 1/P per round
        *[replace(base, name=f"{base.name}-P{p}", syncer_extra=("--fragments", str(p)))
          for p in (2, 4)],
        # --blocking-sync: each island waits for the merged weights after its push
        # (exact DiLoCo); by default islands train on and fold their newer steps in
        replace(base, name=base.name + "-blk", extra=blocking),
        replace(base, name=base.name + "-nest-blk", extra=blocking, **NESTEROV),
        replace(h10, name=h10.name + "-blk", extra=blocking),
        replace(h10, name=h10.name + "-nest-blk", extra=blocking, **NESTEROV),
    ]
    return arms + mixed_arms(rg)


def mixed_arms(rg: Regime) -> list[Arm]:
    """Two islands, island-1 at --slowdown 3, on one wall-clock budget W = the time the
    slow island takes for S steps (S = N/4, as many as a k=4 island makes). Budgets are
    set by max-steps per island, proportional to what each island can do in W under its
    sync rule:
      mixed-time:  sync every T seconds; the fast island does 3S steps, the slow S.
      mixed-steps: sync every H steps; a round needs both pushes (quorum 2) and an
                   island holds one push in flight, so the fast island can be at most
                   one push (H steps) ahead of the slow one: S + H steps, the slow S.
    And mixed3-time: three islands syncing every T seconds, island-0 fast (3S steps),
    the other two at --slowdown 3 (S each): the fast island's delta is the longest,
    the one the centre bound (syncer.bounds, `--center-factor`; k >= 3) could pull in;
    mixed3-time-c0 is the same fleet with the bound off.
    Wall seconds are measured and printed, so the budgets can be checked."""
    S, H = rg.steps // 4, 50
    slow = ((), ("--slowdown", "3"))
    # T: about the slow island's time for H steps (3x a ~45 ms step at L=64, b=8)
    T = 7
    return [
        Arm(rg.name, "mixed-steps", "mixed", k=2, steps=S, batch=rg.batch, H=H,
            island_steps=(S + H, S), per_island=slow, ref="mixed-steps"),
        Arm(rg.name, "mixed-time", "mixed", k=2, steps=S, batch=rg.batch, H=H,
            island_steps=(3 * S, S), extra=("--sync-every-seconds", str(T)),
            per_island=slow, ref="mixed-steps"),
        *(Arm(rg.name, f"mixed3-time{suffix}", "mixed", k=3, steps=S, batch=rg.batch, H=H,
              island_steps=(3 * S, S, S), extra=("--sync-every-seconds", str(T)),
              per_island=((), *slow[1:] * 2), syncer_extra=centre, ref="mixed-steps")
          for suffix, centre in (("", ()), ("-c0", ("--center-factor", "0")))),
    ]


def full_arms(rg: Regime) -> list[Arm]:
    """The DiLoCo paper's Table 2 shape, k = 4, from scratch, full weights."""
    k = 4
    return [
        Arm(rg.name, "single", "single", steps=rg.steps // k, batch=rg.batch, ref=f"dp{k}"),
        Arm(rg.name, "single-same-tokens", "single", steps=rg.steps, batch=rg.batch,
            ref=f"dp{k}"),
        Arm(rg.name, f"dp{k}", "dp", k=k, steps=rg.steps // k, batch=rg.batch * k,
            ref=f"dp{k}"),
        diloco(rg, k, 50), diloco(rg, k, 50, "f32"), diloco(rg, k, 10),
        replace(diloco(rg, k, 50), name="diloco4-H50-q4-nest", **NESTEROV),
        replace(diloco(rg, k, 10), name="diloco4-H10-q4-nest", **NESTEROV),
        replace(diloco(rg, k, 50), name="diloco4-H50-q4-m05", outer_lr=0.7, outer_momentum=0.5),
        replace(diloco(rg, k, 10), name="diloco4-H10-q4-m05", outer_lr=0.7, outer_momentum=0.5),
        replace(diloco(rg, k, 50), name="diloco4-H50-q4-nest-blk", extra=("--blocking-sync",),
                **NESTEROV),
        replace(diloco(rg, k, 50), name="diloco4-H50-q4-rda", merge="rda"),
        replace(diloco(rg, k, 10), name="diloco4-H10-q4-rda", merge="rda"),
        replace(diloco(rg, k, 10), name="diloco4-H10-q4-blk", extra=("--blocking-sync",)),
        Arm(rg.name, f"nomerge{k}", "nomerge", k=k, steps=rg.steps // k, batch=rg.batch,
            ref=f"dp{k}"),
    ]


def long_arms(rg: Regime) -> list[Arm]:
    """DiLoCo's own regime: S inner steps per island in every arm (>= 100 rounds at
    H = 50), the sweeps at that fixed per-island budget (the paper's Table 3 shape),
    dp<k> with the same total tokens. Listed most telling first: arms run in order."""
    S, b = rg.steps, rg.batch
    nest_dq4 = dict(downlink="q4", **NESTEROV)

    def dp(k: int) -> Arm:
        return Arm(rg.name, f"dp{k}", "dp", k=k, steps=S, batch=b * k, ref=f"dp{k}")

    def d(k: int, H: int, wire: str = "q4", suffix: str = "-dq4-nest", **kw) -> Arm:
        kw = kw if suffix != "-dq4-nest" else nest_dq4  # other suffixes state their flags
        return Arm(rg.name, f"diloco{k}-H{H}-{wire}{suffix}", "diloco", k=k, steps=S,
                   batch=b, H=H, wire=wire, ref=f"dp{k}", **kw)

    def grid(k: int) -> list[Arm]:  # outer lr {0.4, 0.7, 1.0} x momentum {0, 0.5, 0.9}
        cells = {(4, 9): "-dq4-o04", (7, 5): "-dq4-m05", (10, 0): "-dq4"}  # named before
        return [replace(d(k, 50, suffix=cells.get((lr, m), f"-dq4-lr{lr:02d}m{m:02d}"),
                          downlink="q4", outer_lr=lr / 10, outer_momentum=m / 10),
                        ref="single" if k == 1 else f"dp{k}")
                for lr, m in itertools.product((4, 7, 10), (0, 5, 9)) if (lr, m) != (7, 9)]

    main = [dp(4), d(4, 50), d(4, 50, suffix=""), d(4, 50, suffix="-dq4", downlink="q4"),
            d(4, 50, "f32", suffix="-nest", **NESTEROV),
            d(4, 50, "bf16", suffix="-nest", **NESTEROV)]
    o04 = dict(downlink="q4", outer_lr=0.4, outer_momentum=0.9)
    single = Arm(rg.name, "single", "single", steps=S, batch=b, ref="single")
    # fragments and merge rules against the plain-averaging q4/q4 arm (uniform is not
    # run: islands of equal batch carry equal tokens, so it equals mean)
    fragments_and_merge = [
        d(4, 50, suffix="-dq4-P2", downlink="q4", syncer_extra=("--fragments", "2")),
        d(4, 50, suffix="-dq4-P4", downlink="q4", syncer_extra=("--fragments", "4")),
        d(4, 50, suffix="-dq4-rda", downlink="q4", merge="rda")]
    if not rg.pretrain:  # from scratch: the main arms, the best warm ones at H = 100, and
        plain = dict(suffix="-dq4", downlink="q4")  # the k and H sweeps with the best rule
        arms = main + [
            d(4, 50, suffix="-dq4-o04", **o04), d(4, 100, suffix="-dq4-o04", **o04),
            d(4, 100, **plain), single, replace(d(1, 50, **plain), ref="single"),
            dp(2), d(2, 50, **plain), dp(8), d(8, 50, **plain),
            d(4, 10, **plain), d(4, 250, **plain), d(4, 1000, **plain),
            *fragments_and_merge, *grid(4)]
        return list({a.name: a for a in arms}.values())
    arms = main + [
        single, replace(d(1, 50), ref="single"),
        dp(2), d(2, 50), dp(8), d(8, 50),
        d(4, 100), d(4, 100, suffix="-dq4", downlink="q4"), d(4, 250), d(4, 1000), d(4, 10),
        d(4, 50, suffix="-dq4-o04", **o04), d(4, 100, suffix="-dq4-o04", **o04),
        d(4, 100, "f32", suffix="-nest", **NESTEROV),
        # the wire cross under Nesterov: uplink f32/bf16/q4 x downlink f32/q4
        d(4, 50, suffix="-nest", **NESTEROV), d(4, 50, "f32"), d(4, 50, "bf16"),
        *grid(4), *fragments_and_merge,
        *grid(2), *grid(8), *grid(1),  # the outer grid per k (k = 4 above; k = 1 to single)
    ]
    return list({a.name: a for a in arms}.values())  # each once, where it first appears


def plan(mode: str, model: str | None = None) -> tuple[dict[str, Regime], list[Arm], list[int]]:
    """The regimes, arms and seeds of a mode; `model` is --real's base (default
    SmolLM2-135M-Instruct's GGUF file)."""
    if mode == "real":
        regimes, arms = real_plan(model)
        return regimes, arms, [0, 1]
    if mode == "smoke":
        rg = Regime("lora", "lora", True, "task", steps=24, batch=4, seq_len=64, inner_lr=3e-3,
                    lora_r=8)
        arms = [Arm("lora", "single", "single", steps=24, batch=4, ref="single"),
                replace(diloco(rg, 2, 6), ref="single")]
        return {"lora": rg}, arms, [0]
    if mode in ("rules", "quick"):  # quick: the default rule's short cell, and dp4
        regimes, arms = rules_plan()
        if mode == "quick":
            arms = [a for a in arms if a.regime == "short"
                    and (a.kind == "dp" or candidate_of(a) == DEFAULT)]
        return regimes, arms, [0, 1, 2]
    if mode == "long":  # full weights, stdlib source, >= 100 rounds through yeto.sim
        warm = Regime("warm", "full", True, "stdlib", steps=5000, batch=4, seq_len=32,
                      inner_lr=1e-3, sim=True, eval_blocks=128)
        scratch = replace(warm, name="scratch", pretrain=False)
        return {"warm": warm, "scratch": scratch}, long_arms(warm) + long_arms(scratch), [0, 1]
    lora = Regime("lora", "lora", True, "task", steps=1600, batch=8, seq_len=64,
                  inner_lr=3e-3)
    full = Regime("full", "full", False, "stdlib", steps=1200, batch=8, seq_len=128,
                  inner_lr=2e-3)
    return {"lora": lora, "full": full}, lora_arms(lora) + full_arms(full), [0, 1]


# ---------------------------------------------------------------- outer rules (--rules)

# name -> (--outer, --outer-lr, --outer-momentum); the arm's suffix is "-name" ("" for avg,
# so the arm names of earlier tables hold)
CANDIDATES = {
    "avg": ("nesterov", 1.0, 0.0),            # plain averaging
    "o04": ("nesterov", 0.4, 0.9),            # the best long warm cell of the outer grid
    "bc": ("nesterov-bc", 0.4, 0.9),
    "warmup": ("nesterov-warmup", 0.4, 0.9),
    "agree": ("nesterov-agree", 0.4, 0.9),
    "restart": ("nesterov-restart", 0.4, 0.9),
}
# the syncer's default rule for SFT islands (syncer.run.Config's `auto` is nesterov-warmup
# until a GRPO island joins; the sim's islands train SFT); --quick runs it
DEFAULT = "warmup"
# the cells of the rules table: (regime, k, H); the last, the larger model, runs
# LARGER_RULES only (the default and the candidate for it)
CELLS = (("short", 4, 50), ("warm", 4, 100), ("warm", 8, 100), ("scratch", 4, 50),
         ("scratch", 4, 100), ("warm2m", 4, 100))
LARGER_RULES = ("avg", "warmup")


def rule_arm(rg: Regime, k: int, H: int, cand: str, steps: int) -> Arm:
    outer, lr, mu = CANDIDATES[cand]
    suffix = "" if cand == "avg" else f"-{cand}"
    return Arm(rg.name, f"diloco{k}-H{H}-q4-dq4{suffix}", "diloco", k=k, steps=steps,
               batch=rg.batch, H=H, downlink="q4", outer=outer, outer_lr=lr,
               outer_momentum=mu, ref=f"dp{k}")


def rules_plan() -> tuple[dict[str, Regime], list[Arm]]:
    """The regimes and arms of `--rules`: dp<k> first, then every candidate per cell."""
    short = Regime("short", "lora", True, "task", steps=1600, batch=8, seq_len=64,
                   inner_lr=3e-3, sim=True)
    warm = Regime("warm", "full", True, "stdlib", steps=5000, batch=4, seq_len=32,
                  inner_lr=1e-3, sim=True, eval_blocks=128)  # as --long: caches agree
    regimes = {"short": short, "warm": warm,
               "scratch": replace(warm, name="scratch", pretrain=False),
               "warm2m": replace(warm, name="warm2m", size="small")}
    arms: list[Arm] = []
    for name, k, H in CELLS:
        rg = regimes[name]
        per_island = rg.steps // k if name == "short" else rg.steps  # short: same tokens
        arms += cell_arms(rg, k, H, LARGER_RULES if rg.size != "tiny" else CANDIDATES,
                          per_island)
    return regimes, list({a.key: a for a in arms}.values())


def cell_arms(rg: Regime, k: int, H: int, rules, per_island: int) -> list[Arm]:
    """A cell's arms: dp<k> (one island, k x the batch, as many steps per island as a
    DiLoCo island makes), then each rule's DiLoCo arm."""
    dp = Arm(rg.name, f"dp{k}", "dp", k=k, steps=per_island, batch=rg.batch * k, ref=f"dp{k}")
    return [dp, *(rule_arm(rg, k, H, c, per_island) for c in rules)]


def cell_of(arm: Arm) -> tuple[str, int, int] | None:
    """The rules-table (or --real table) cell a DiLoCo arm belongs to, None for another."""
    cell = (arm.regime, arm.k, arm.H)
    return cell if arm.kind == "diloco" and (cell in CELLS or cell in REAL_CELLS) else None


def candidate_of(arm: Arm) -> str | None:
    """The candidate an arm runs (by its outer rule, lr and momentum), None if none."""
    flags = (arm.outer, arm.outer_lr, arm.outer_momentum)
    return next((c for c, f in CANDIDATES.items() if f == flags), None)


# ---------------------------------------------------------------- real text (--real)

# N, the single-island steps of --real's token budget: N x REAL_BATCH blocks of 128 tokens,
# about one pass over stdlib_docs' 125 training blocks (SmolLM2's tokenizer), sized for
# ~45 minutes on one CPU core; each k-island cell runs N/k steps per island and syncs every
# N/(4k): 4 rounds
REAL_STEPS, REAL_BATCH = 64, 2
REAL_CELLS = tuple(("real", k, REAL_STEPS // k // 4) for k in (2, 4))
REAL_RULES = (DEFAULT, "avg")  # the syncer's default for SFT, and plain averaging


def real_plan(model: str | None = None) -> tuple[dict[str, Regime], list[Arm]]:
    """--real: LoRA r16 on a real base and real text, dp<k> and each REAL_RULES arm per
    REAL_CELLS cell, every arm on the same tokens (N x b)."""
    if model is None:
        from yeto.testing.real import SMOLLM2

        model = str(SMOLLM2.path)
    rg = Regime("real", "lora", True, "docs", steps=REAL_STEPS, batch=REAL_BATCH, seq_len=128,
                inner_lr=1e-3, sim=True, base=model)
    arms = [a for _, k, H in REAL_CELLS for a in cell_arms(rg, k, H, REAL_RULES, rg.steps // k)]
    return {rg.name: rg}, arms


def config_of(arm: Arm, rg: Regime, seed: int) -> dict:
    """What an arm's result depends on (its name and reference arm do not count)."""
    drop = {"name", "ref"} | ({"syncer_extra"} if not arm.syncer_extra else set())
    if arm.outer == "nesterov":  # the rule earlier caches ran: their digests hold
        drop.add("outer")
    if arm.kind not in ("diloco", "mixed"):  # no syncer: the outer settings do not apply
        drop |= {"H", "wire", "outer", "outer_lr", "outer_momentum", "merge", "downlink"}
    what = {k: v for k, v in asdict(arm).items() if k not in drop}
    regime = asdict(rg)
    if not rg.base:  # the tiny model, as every earlier cache: their digests hold; a real
        del regime["base"]  # base is keyed by its path (GGUF file or model dir)
    if rg.size == "tiny":  # the size every earlier cache ran: their digests hold
        del regime["size"]
    else:  # the base's cache key: a changed shape or pretraining recipe is a new result
        from yeto.testing.tiny import cache_key

        regime["model"] = cache_key("llama", 0, rg.pretrain, rg.size)
    return {"arm": what, "regime": regime, "seed": seed, "data": DATA_VERSION}


def capped(arms: list[Arm], n: int) -> list[Arm]:
    """The arms with at most n steps per island (--max-steps)."""
    if n < 1:
        raise SystemExit(f"--max-steps {n}: give at least 1 step per island, e.g. --max-steps 300")
    return [replace(a, steps=min(a.steps, n),
                    island_steps=tuple(min(x, n) for x in a.island_steps)) for a in arms]


def choose(arms: list[Arm], pick: str) -> list[Arm]:
    """The arms matching a comma list of glob patterns, and their reference arms."""
    pats = [x.strip() for x in pick.split(",") if x.strip()]
    chosen = {a.key for a in arms if any(fnmatch.fnmatchcase(a.key, pt) for pt in pats)}
    chosen |= {f"{a.regime}:{a.ref}" for a in arms if a.key in chosen and a.ref}  # for ratio
    return [a for a in arms if a.key in chosen]
