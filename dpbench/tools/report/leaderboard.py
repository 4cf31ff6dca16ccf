"""`dpbench-report --leaderboard DIR`: dpbench's own benchmark table.

Per task (dataset, model) and target ε, every method ranked by accuracy (mean ± SE over seeds),
with its own peak memory and throughput beside DP-Adam's (per-example gradients materialised) and
non-private Adam's, the ε it spent, its steps, and whether it lies on the accuracy-vs-memory Pareto
frontier of the private methods. Non-private runs are the ceiling of every ε of their task.

Compute is compared in forward-pass equivalents (an example's forward 1, its backward 2, counted as
the passes ran: dpbench/algorithms/compute.py), per example and in total beside DP-Adam's. Runs
given one `train.compute_budget` form their own board, at equal compute (each method's steps set
from its cost per example, so zeroth-order methods take more), beside the board of the runs
without one. Wall time and samples/s are shown for information only: on shared cores they are noise.

A method is the algorithm plus its per-example engine when that is not the default
(`dpadam_ghost`, `dpadam_bk`: load.method_name); `report.expect` names methods the same way.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from dpbench.tools.report.agreement import kendall
from dpbench.tools.report.formatting import fmt, fmt_any, fmt_eps
from dpbench.tools.report.groups import Group, accuracy_percent
from dpbench.tools.report.load import method_name
from dpbench.tools.report.tables import flags

PRIVATE_REFERENCE = "dpadam"     # DP-Adam materialising every per-example gradient
PUBLIC_REFERENCE = "adam"        # non-private Adam
WALL = "wall min (info)"  # information only: shared cores make wall time noise (COMPUTE_NOTE)
HEADER = ["rank", "method", "accuracy %", "seeds", "own peak MiB", "mem ÷ DP-Adam", "mem ÷ Adam",
          "samples/s", "speed ÷ DP-Adam", WALL, "ε spent", "steps", "fwd-eq / example", "compute ÷ DP-Adam",
          "Pareto", "flags"]
NUMERIC = ("seeds", "own peak MiB", "mem ÷ DP-Adam", "mem ÷ Adam", "samples/s", "speed ÷ DP-Adam", WALL, "steps",
           "fwd-eq / example", "compute ÷ DP-Adam")
COMPUTE_NOTE = ("compute: forward-pass equivalents (fwd-eq) of training, an example's forward 1 and its backward 2, "
                "counted as the passes ran (ghost clipping's second backward, DC-DPSGD's recomputed chunks and "
                "DPZero's two forwards included); samples/s and wall time are for information only (shared cores "
                "make them noise)")
PLANNED_FLAG = "compute planned, not measured (log_private_stats=false)"
PARETO_MARK = "★"
CEILING = "ceiling"


@dataclass
class Entry:
    """One method on one board: the statistics of its seeds."""

    method: str
    group: Group
    accuracy: float | None = None       # %, mean over seeds
    accuracy_se: float | None = None
    rank: int | None = None             # among the private methods of the board (None: the ceiling)
    pareto: bool = False
    memory_ratio_private: float | None = None   # own peak ÷ DP-Adam's
    memory_ratio_public: float | None = None    # own peak ÷ Adam's
    speed_ratio: float | None = None            # samples/s ÷ DP-Adam's
    compute_ratio: float | None = None          # forward-pass equivalents ÷ DP-Adam's

    @property
    def private(self) -> bool:
        return self.group.first.private

    @property
    def own_mib(self) -> float | None:
        return self.group.mean("own_mib")

    @property
    def samples_per_s(self) -> float | None:
        return self.group.mean("samples_per_s")

    @property
    def wall_minutes(self) -> float | None:
        """The mean run's wall time (throughput.wall_s: the whole job, cache and evaluations included;
        None where privacy.log_private_stats=false withheld it, as a private study's trials do)."""
        wall = self.group.mean("wall_s")
        return None if wall is None else wall / 60

    @property
    def epsilon(self) -> float | None:
        return self.group.mean("epsilon") if self.private else None

    @property
    def compute_planned(self) -> bool:
        """Whether the compute shown is the plan (the runs withheld their measured count)."""
        return self.group.mean("forward_equivalents") is None and self.group.mean("planned_forward_equivalents") is not None

    @property
    def forward_equivalents(self) -> float | None:
        """The mean run's forward-pass equivalents in training: measured, else planned (None: a run before schema 9)."""
        return self.group.mean("planned_forward_equivalents") if self.compute_planned else self.group.mean("forward_equivalents")

    @property
    def per_example(self) -> float | None:
        """Forward-pass equivalents per example trained on: measured, else the algorithm's declaration."""
        return self.group.mean("planned_per_example") if self.compute_planned else self.group.mean("compute_per_example")


@dataclass
class Board:
    """The leaderboard of one task at one target ε (None: a task with non-private runs only)."""

    dataset: str | None
    model: str | None
    epsilon: float | None
    metric: str
    metric_name: str
    entries: list[Entry] = field(default_factory=list)
    budget: float | None = None  # train.compute_budget of its runs (None: the runs without one)

    @property
    def task(self) -> str:
        """The task, and for runs under a compute budget the budget: its figures and fairness are its own."""
        base = f"{self.dataset} · {self.model}"
        return base if self.budget is None else f"{base} · equal compute {self.budget:g}"

    @property
    def held_equal(self) -> str:
        """What the board holds equal across methods: compute (a budget), examples (every method's
        steps × batch size the same), or neither (nothing said: the fairness statement shows the steps)."""
        if self.budget is not None:
            return f"equal compute: {self.budget:g} forward-pass equivalents per training example"
        seen = {(e.group.first.steps or 0) * (e.group.first.batch_size or 0) for e in self.entries}
        return "equal examples" if len(seen) == 1 and 0 not in seen else ""

    @property
    def title(self) -> str:
        base = f"{self.dataset} · {self.model} · ε = {fmt_eps(self.epsilon)}"
        return f"{base} · {self.held_equal}" if self.held_equal else base

    @property
    def memory_kind(self) -> str:
        kinds = {e.group.first.memory_kind or "" for e in self.entries}
        if any(k.startswith("cuda") for k in kinds):
            return "own peak = torch.cuda.max_memory_allocated"
        return "own peak = peak resident size minus the resident size at the start of the run"

    def reference(self, method: str) -> Entry | None:
        """The entry of `method`; else the same algorithm under another engine (`dpadam_bk` when the
        board ran DP-Adam with book-keeping only)."""
        exact = next((e for e in self.entries if e.method == method), None)
        return exact or next((e for e in self.entries if e.method.startswith(method + "_")), None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _dominated(e: Entry, others: list[Entry]) -> bool:
    return any(o.accuracy >= e.accuracy and o.own_mib <= e.own_mib and (o.accuracy > e.accuracy or o.own_mib < e.own_mib)
               for o in others if o is not e)


def _labels(groups: list[Group]) -> dict[int, str]:
    """Method names; groups of one method that differ in more than the engine get their setting added."""
    names = {id(g): method_name(g.first) for g in groups}
    by_name = defaultdict(list)
    for g in groups:
        by_name[names[id(g)]].append(g)
    for name, same in by_name.items():
        if len(same) > 1:
            for g in same:
                shown = {k: v for k, v in g.setting.items() if k != "algo.per_sample" and not k.startswith("run.")}
                names[id(g)] = f"{name} ({', '.join(f'{k}={fmt_any(v)}' for k, v in shown.items())})"
    return names


def build_boards(groups: list[Group], metric: str) -> list[Board]:
    """One board per task, compute budget (None first: the runs without one) and target ε;
    non-private groups join every ε of their task and budget."""
    by_task: dict[tuple, list[Group]] = defaultdict(list)
    for g in groups:
        by_task[(g.first.dataset, g.first.model, g.first.compute_budget)].append(g)
    boards = []
    for (dataset, model, budget), members in sorted(by_task.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]),
                                                                                     kv[0][2] is not None, kv[0][2] or 0)):
        public = [g for g in members if not g.first.private]
        epsilons = sorted({g.first.target_epsilon for g in members if g.first.private}, key=lambda e: (e is None, e or 0.0))
        metric_name = next((g.first.metric_name for g in members if g.first.metric_name), "accuracy")
        for eps in epsilons or [None]:
            on_board = [g for g in members if g.first.private and g.first.target_epsilon == eps] + public
            names = _labels(on_board)
            board = Board(dataset, model, eps, metric, metric_name, budget=budget)
            for g in on_board:
                mean, se = accuracy_percent(g, metric)
                board.entries.append(Entry(names[id(g)], g, mean, se))
            _rank(board)
            boards.append(board)
    return boards


def _rank(board: Board) -> None:
    """Order (ceiling first, then private methods by accuracy), ratios and the Pareto frontier."""
    private = [e for e in board.entries if e.private]
    ordered = sorted(private, key=lambda e: (e.accuracy is None, -(e.accuracy or 0.0), e.method))
    previous, rank = None, 0
    for position, e in enumerate(ordered, start=1):
        if e.accuracy is not None:
            rank = rank if previous is not None and e.accuracy == previous else position  # ties share a rank
            e.rank, previous = rank, e.accuracy
    known = [e for e in private if e.accuracy is not None and e.own_mib is not None]
    for e in known:
        e.pareto = not _dominated(e, known)
    public = sorted((e for e in board.entries if not e.private), key=lambda e: e.method)
    board.entries = public + ordered
    dp_adam, adam = board.reference(PRIVATE_REFERENCE), board.reference(PUBLIC_REFERENCE)
    for e in board.entries:
        e.memory_ratio_private = _ratio(e.own_mib, dp_adam.own_mib if dp_adam else None)
        e.memory_ratio_public = _ratio(e.own_mib, adam.own_mib if adam else None)
        e.speed_ratio = _ratio(e.samples_per_s, dp_adam.samples_per_s if dp_adam else None)
        e.compute_ratio = _ratio(e.forward_equivalents, dp_adam.forward_equivalents if dp_adam else None)


def pareto_front(board: Board) -> list[Entry]:
    """The frontier's entries by increasing memory (each more accurate than the one before)."""
    return sorted((e for e in board.entries if e.pareto), key=lambda e: e.own_mib)


def memory_flag(group: Group) -> str:
    """A CPU own peak metered without the warm-up (runs before it) may hold the imports the first job
    of a process pays alone: the board cannot vouch for its memory ratios."""
    unwarmed = [r for r in group.rows if (r.memory_kind or "").startswith("cpu") and r.memory_warmed_up is not True]
    return "own peak metered without the warm-up: may include a process's first imports" if unwarmed else ""


def board_table(board: Board) -> tuple[list[str], list[list[str]]]:
    body = []
    for e in board.entries:
        accuracy = fmt(e.accuracy, ".1f") + ("" if e.accuracy_se is None else f" ± {e.accuracy_se:.1f}")
        body.append([
            CEILING if not e.private else fmt_any(e.rank), e.method, accuracy, str(len(e.group.rows)),
            fmt(e.own_mib, ".1f"), fmt(e.memory_ratio_private, ".2f"), fmt(e.memory_ratio_public, ".2f"),
            fmt(e.samples_per_s, ".1f"), fmt(e.speed_ratio, ".2f"), fmt(e.wall_minutes, ".1f"),
            fmt_eps(e.epsilon, ".2f"), fmt_any(e.group.first.steps), fmt(e.per_example, ".2f"),
            fmt(e.compute_ratio, ".2f"), PARETO_MARK if e.pareto else "",
            "; ".join(f for f in (flags(e.group), memory_flag(e.group), PLANNED_FLAG if e.compute_planned else "") if f),
        ])
    header = list(HEADER)
    header[2] = f"{board.metric} {board.metric_name} % (mean ± SE)"
    return header, body


def csv_table(boards: list[Board]) -> tuple[list[str], list[list[str]]]:
    """All boards as one table (dataset, model, target ε and compute budget as columns)."""
    header, body = ["dataset", "model", "target ε", "compute budget"], []
    for board in boards:
        board_header, rows = board_table(board)
        body += [[str(board.dataset), str(board.model), fmt_eps(board.epsilon), fmt_any(board.budget)] + row for row in rows]
    return header + (board_table(boards[0])[0] if boards else HEADER), body


def records(boards: list[Board]) -> tuple[list[str], list[list]]:
    """All boards with numbers as numbers (None where unknown): the W&B Table, sortable."""
    columns = ["dataset", "model", "target_epsilon", "rank", "method", "accuracy_pct", "accuracy_se_pct", "seeds",
               "own_peak_mib", "memory_vs_dpadam", "memory_vs_adam", "samples_per_s", "speed_vs_dpadam",
               "wall_minutes", "epsilon_spent", "steps", "forward_equivalents_per_example", "forward_equivalents",
               "compute_vs_dpadam", "compute_budget", "pareto", "private", "flags"]
    data = [[b.dataset, b.model, b.epsilon, e.rank, e.method, e.accuracy, e.accuracy_se, len(e.group.rows), e.own_mib,
             e.memory_ratio_private, e.memory_ratio_public, e.samples_per_s, e.speed_ratio, e.wall_minutes, e.epsilon,
             e.group.first.steps, e.per_example, e.forward_equivalents, e.compute_ratio, b.budget, e.pareto, e.private,
             flags(e.group)] for b in boards for e in b.entries]
    return columns, data


# ---------------------------------------------------------------- fairness: what is equal, where values come from


@dataclass
class Fairness:
    """What the methods of a task share and what each does its own way, read from their configs."""

    task: str
    equal: list[tuple[str, str]]                 # (what, value)
    differing: list[tuple[str, dict[str, str]]]  # (what, {value: methods})
    sources: list[tuple[str, str, str, str, str]]  # (method, lr, C, steps, where the values come from)


def _config(key: str):
    return lambda r: r.config.get(key)


# What the fairness statement compares: (label, how to read it from a run, whether only private
# runs carry it). Unknown values (None: an old file, a key this task does not have) are left out.
SHARED = [
    ("dataset", lambda r: r.dataset, False),
    ("training examples", lambda r: r.train_size, False),
    ("test examples", lambda r: r.config.get("dataset.num_test") or r.config.get("dataset.test_size"), False),
    ("model", lambda r: r.model, False),
    ("weights", _config("model.dtype"), False),
    ("precision", _config("train.precision"), False),
    ("batch size (logical)", lambda r: r.batch_size, False),
    ("physical batch", lambda r: r.config.get("train.physical_batch_size") or r.batch_size, False),
    ("steps", lambda r: r.steps, False),
    ("compute budget (fwd-eq per training example)", lambda r: r.compute_budget, False),
    ("δ", _config("privacy.delta"), True),
    ("accountant", lambda r: r.accountant, True),
    ("sampling", lambda r: r.sampling, True),
    ("neighbouring relation", _config("privacy.neighboring"), True),
    ("clipping rule", lambda r: r.clipping, True),
    ("device", lambda r: r.device, False),
]


def fairness(boards: list[Board]) -> list[Fairness]:
    """Per task: the settings every method shares (target ε is equal on each board by construction),
    those that differ (with the methods on each side), and each method's hyperparameters and source."""
    by_task: dict[str, list[Board]] = defaultdict(list)
    for board in boards:
        by_task[board.task].append(board)
    out = []
    for task, task_boards in by_task.items():
        entries: dict[str, Entry] = {}
        for board in task_boards:
            for e in board.entries:
                entries.setdefault(e.method, e)
        seeds = {m: ", ".join(sorted({fmt_any(r.seed) for b in task_boards for x in b.entries if x.method == m for r in x.group.rows}))
                 for m in entries}
        equal, differing = [], []
        for label, read, private_only in SHARED + [("seeds", None, False)]:
            values: dict[str, list[str]] = defaultdict(list)
            for method, e in sorted(entries.items()):
                value = seeds[method] if read is None else read(e.group.first)  # seeds: of every board
                if value is not None and (e.private or not private_only):
                    values[fmt_any(value)].append(method)
            if len(values) == 1:
                equal.append((label, next(iter(values))))
            elif values:
                differing.append((label, {v: ", ".join(ms) for v, ms in values.items()}))
        equal.insert(1, ("target ε", ", ".join(fmt_eps(b.epsilon) for b in task_boards) + " (one board each; non-private runs: ∞)"))
        sources = []
        for method, e in sorted(entries.items()):
            r = e.group.first
            source = r.config.get(f"paper_setting.source.{r.algo}") or "not recorded (the run's own config)"
            clip = fmt_any(r.config.get("privacy.clip_norm")) if e.private else "—"
            sources.append((method, fmt_any(r.config.get("train.lr")), clip, fmt_any(r.steps), str(source)))
        out.append(Fairness(task, equal, differing, sources))
    return out


def fairness_markdown(items: list[Fairness]) -> str:
    lines = []
    for item in items:
        lines += [f"**Fairness: {item.task}**", "", "Held equal across methods: "
                  + "; ".join(f"{what} {value}" for what, value in item.equal) + "."]
        if item.differing:
            lines += ["", "Differs between methods (by design; the sources below say why):"]
            for what, sides in item.differing:
                lines.append(f"- {what}: " + "; ".join(f"{value} ({methods})" for value, methods in sides.items()))
        lines += ["", "| method | lr | C | steps | hyperparameters from |", "|---|---|---|---|---|"]
        lines += [f"| {m} | {lr} | {c} | {steps} | {source.replace('|', '/')} |" for m, lr, c, steps, source in item.sources]
        lines.append("")
    return "\n".join(lines).rstrip("\n")


MIN_SEEDS = 3  # a ranking on fewer seeds gets a caveat: one seed has no standard error at all


def ranking_caveats(board: Board) -> list[str]:
    """What the ranking cannot claim: methods on fewer than MIN_SEEDS seeds, and neighbouring ranks
    whose accuracy gap is under 2 SE of the difference (√(SE₁² + SE₂²)): a reader should not take
    their order as settled."""
    ranked = [e for e in board.entries if e.rank is not None]
    few = [f"{e.method} ({len(e.group.rows)})" for e in ranked if len(e.group.rows) < MIN_SEEDS]
    close = []
    for upper, lower in zip(ranked, ranked[1:]):
        if upper.accuracy_se is None or lower.accuracy_se is None:
            continue  # a one-seed row: the seeds caveat covers it
        se = (upper.accuracy_se ** 2 + lower.accuracy_se ** 2) ** 0.5
        if upper.accuracy - lower.accuracy < 2 * se:
            close.append(f"{upper.method} vs {lower.method} ({upper.accuracy - lower.accuracy:.1f} < 2 SE = {2 * se:.1f})")
    lines = []
    if few:
        lines.append(f"{board.title}: caveat: ranked on fewer than {MIN_SEEDS} seeds: {', '.join(few)}")
    if close:
        lines.append(f"{board.title}: caveat: gaps under 2 SE, order not settled: {'; '.join(close)}")
    return lines


def headline(boards: list[Board]) -> list[str]:
    """One line per board: the most accurate private method and the Pareto frontier, and the caveats
    of its ranking; then, per task with several ε, how well the rankings at each pair of ε agree."""
    lines = []
    for b in boards:
        best = next((e for e in b.entries if e.rank == 1), None)
        front = ", ".join(e.method for e in pareto_front(b))
        if best is not None:
            lines.append(f"{b.title}: most accurate private method {best.method} ({fmt(best.accuracy, '.1f')}%); "
                         f"accuracy-vs-memory Pareto frontier: {front or '—'}")
        lines += ranking_caveats(b)
    return lines + epsilon_agreement(boards)


def private_accuracies(board: Board) -> dict[str, float]:
    return {e.method: e.accuracy for e in board.entries if e.private and e.accuracy is not None}


def epsilon_agreement(boards: list[Board]) -> list[str]:
    """Kendall's τ between the private rankings of one task at two target ε (methods on both)."""
    lines = []
    for i, first in enumerate(boards):
        for second in boards[i + 1:]:
            if first.task != second.task or None in (first.epsilon, second.epsilon):
                continue
            agreement = kendall(private_accuracies(first), private_accuracies(second))
            if agreement is not None:
                lines.append(f"{first.task}: rankings at ε = {fmt_eps(first.epsilon)} and ε = {fmt_eps(second.epsilon)} "
                             f"agree with {agreement.describe()}: {', '.join(agreement.methods)}")
    return lines
