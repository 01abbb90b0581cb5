"""Agent sessions: one cache across many edits, repaired per edit, against Re-prefill after every edit (notebook 07).

An episode is a multi-turn context built from the QA data: a task turn, then for each of k source questions an outdated
search result (distractor passages of that question) followed by the search result that supersedes it (its supporting
passages). The agent then works through the questions: edit i deletes the i-th outdated result from the live cache and
question i is asked. Every repair policy (an :class:`~sur_lab.session.EditSession` fork of one prefill) follows the same
edits: Shift only, SUR at b % per edit, SUR with a staleness-debt budget, and Re-prefill after every edit, the
reference. Per edit the study records answer EM, agreement with Re-prefill's answer, the tokens forwarded and the
repair time, the K/V deviation of the live cache from a clean prefill (Re-prefill's cache) and the staleness debt.
Given a folder, :func:`run_episodes` stores the rows through the one sweep store (keyed rows of
:meth:`sur_lab.sweeps.SweepStore.run_keyed`, an episode per case) and resumes finished episodes.

Source: section 3 (evolving contexts; Eq. 2 Shift, Eq. 3 budget), Algorithm 1 per edit, appendix 14 (stale causal
predecessors), appendix 7.5 (EM, agreement).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import MaxNLocator
from tqdm.auto import tqdm

from sur_lab.analysis.conclusions import paired_outcomes
from sur_lab.analysis.decisions import COLUMNS, Family, Margin, PowerBasis, PowerDesign, family_lines, paired_family
from sur_lab.analysis.endpoints import row_deviation
from sur_lab.analysis.plotting import token_pieces, token_view
from sur_lab.analysis.scoring import agreement, extract_answer, score_example
from sur_lab.cache_ops import to_tensors
from sur_lab.data.qa import QAExample, select_sources
from sur_lab.data.text import passage_block
from sur_lab.fingerprint import digest, model_fingerprint, versions
from sur_lab.models import LoadedModel
from sur_lab.session import EditSession
from sur_lab.sweeps.store import SweepStore

TASK = ("You are a research agent. Search results arrive as tool outputs; outdated results are removed when a newer "
        "one supersedes them. Answer each question with a short answer only.")
REFERENCE = "Re-prefill"
#: The table :func:`run_episodes` writes in its ``out`` folder.
TABLE_FILE = "edits.parquet"
#: The budget of the per-edit SUR arm compared with Re-prefill when no debt arm ran at one of the per-edit budgets
#: (:func:`lead_arm`): notebook 07's default debt budget, % per edit.
LEAD_BUDGET = 5.0
#: "No more than 5 points of agreement lost against re-prefill" (issue 27's tolerance, the one notebook 10 declares as
#: ``agent_traces.AGREEMENT_MARGIN``; stated again here with the same reason, since studies never import each other
#: and moving it into :mod:`sur_lab.analysis.decisions` would change the inputs of every notebook): the equivalence
#: margin of :data:`REPREFILL_FAMILY`.
MAX_AGREEMENT_LOSS = 0.05
AGREEMENT_MARGIN = Margin(MAX_AGREEMENT_LOSS, "issue 27's tolerance: at most 5 points of agreement lost against "
                          "re-prefill")
#: The declared comparisons of notebook 07 (issue 36; :mod:`sur_lab.analysis.decisions`), fixed before any run, on
#: agreement with Re-prefill, paired by question with an episode's questions clustered: the debt arm against SUR at
#: its budget alone (does spending budget on the debt move the answers?), tested alone; per-edit SUR at the lead
#: budget against Re-prefill, "equivalent" only when its whole 90 % interval lies within :data:`AGREEMENT_MARGIN`;
#: and each per-edit SUR budget against Shift, with Holm.
PRIMARY = Family("primary", "binary", "the debt arm minus SUR at the debt arm's budget, agreement with Re-prefill",
                 primary=True)
#: Does per-edit SUR keep Re-prefill's answers? Re-prefill agrees with itself on every question, so the difference is
#: minus SUR's rate of answers that differ from Re-prefill's: it can only be shown to lose, or to lose at most the
#: margin. Equivalence needs about 55 questions without a loss (Newcombe's 90 % interval; more with losses or with
#: few episodes): notebook 07's default size (2 episodes of 10 edits) is too small to show it and says so. A debt arm
#: shown to beat SUR (:data:`PRIMARY`) shows SUR losing Re-prefill's answers on the same questions, and
#: :func:`~sur_lab.analysis.decisions.judge` reads a shown loss before equivalence: that run says "loses to" here even
#: when the loss lies within the margin.
REPREFILL_FAMILY = Family("per-edit SUR against Re-prefill", "binary",
                          "per-edit SUR at the lead budget (the debt arm's, else 5 % when it ran, else the first "
                          "per-edit budget) minus Re-prefill, agreement with Re-prefill", margin=AGREEMENT_MARGIN,
                          max_size=1)
BUDGET_FAMILY = Family("per-edit SUR against Shift", "binary",
                       "SUR at each per-edit budget minus Shift, agreement with Re-prefill")
#: The power statement's basis (issue 40; :func:`mde`): a planning value, not a measurement. No paper reports this
#: comparison; the debt arm and SUR are taken to disagree with each other on a quarter of the questions (they share
#: every edit's SUR support and differ only where the debt refresh changes an answer).
PRIMARY_POWER = PowerBasis(0.25, "a planning value (no published rate): a quarter of the questions discordant")


#: The primary comparison's power design: :func:`mde` and :func:`power_line` at notebook 07's size.
POWER = PowerDesign("the debt arm vs SUR at its budget, agreement", PRIMARY, PRIMARY_POWER,
                    lambda p: (p["n_episodes"], p["k"]), what="questions", clusters="episodes")


def mde(p: Mapping[str, int]) -> tuple[float, str]:
    """The primary comparison's (:data:`PRIMARY`) minimal detectable effect at 80 % power, two-sided 5 %, for
    notebook 07's size ``p`` (``n_episodes`` episodes, the clusters, of ``k`` questions each) and the stated
    discordance rate :data:`PRIMARY_POWER`: ``(points, "pp")`` (:func:`sur_lab.analysis.decisions.mde`; NaN when the
    size cannot reach 80 %: the exact sign test on 5 episodes or fewer never reaches p < 0.05)."""
    return POWER.mde(p)


def power_line(p: Mapping[str, int]) -> str:
    """:func:`mde` in words, for notebook 07's "This run" cell (:func:`sur_lab.analysis.decisions.power_sentence`)."""
    return POWER.line(p)


@dataclass(frozen=True)
class Arm:
    """One repair policy applied after every edit.

    Attributes:
        label: display name (``"SUR 5%"``).
        method: ``"Shift"``, ``"Re-prefill"`` or an allocator name.
        budget_pct: b per edit, % of the edit's suffix (NaN for reference methods).
        debt_pct: staleness-debt budget, % of the stale rows left after the edit's repair.
    """

    label: str
    method: str
    budget_pct: float = float("nan")
    debt_pct: float = 0.0


def default_arms(budgets: Sequence[float] = (2, 5, 10), *, debt_budget: float = 5.0, debt_pct: float = 0.0,
                 method: str = "SUR") -> list[Arm]:
    """Shift, ``method`` at each budget, optionally ``method`` at ``debt_budget`` plus a debt budget, Re-prefill.

    Raises:
        ValueError: naming ``budgets`` when empty.
    """
    if not len(budgets):
        raise ValueError("budgets is empty; give at least one budget in [0, 100]")
    arms = [Arm("Shift", "Shift")]
    arms += [Arm(f"{method} {b:g}%", method, float(b)) for b in budgets]
    if debt_pct > 0:
        arms.append(Arm(f"{method} {debt_budget:g}% + debt {debt_pct:g}%", method, float(debt_budget), float(debt_pct)))
    return arms + [Arm(REFERENCE, REFERENCE)]


@dataclass(frozen=True)
class Turn:
    """One message of an episode: its rendered text, what it holds, and the question index it belongs to."""

    text: str
    kind: str  # "head", "outdated" or "current"
    index: int


@dataclass(frozen=True)
class Episode:
    """A multi-turn context and its k questions.

    Attributes:
        id: episode id (dataset and the first source's id).
        turns: rendered messages in context order (their concatenation is the pre-query context).
        queries: rendered query text of each question (user turn plus the generation prompt), in edit order.
        examples: the k source questions (gold answers for EM), in edit order.
    """

    id: str
    turns: tuple[Turn, ...]
    queries: tuple[str, ...]
    examples: tuple[QAExample, ...]

    @property
    def k(self) -> int:
        return len(self.examples)


def _render_turns(tokenizer, messages: list[dict]) -> tuple[list[str], str]:
    """Each message's rendered text (differences of growing renders) and the template's generation-prompt tail."""
    texts, prev = [], ""
    for i in range(1, len(messages) + 1):
        full = tokenizer.apply_chat_template(messages[:i], tokenize=False, enable_thinking=False)
        if not full.startswith(prev):
            raise ValueError("the chat template is not prefix-stable; turns cannot be rendered one by one")
        texts.append(full[len(prev):])
        prev = full
    return texts, prev


def _query_text(tokenizer, messages: list[dict], question: str, context: str) -> str:
    full = tokenizer.apply_chat_template(
        messages + [{"role": "user", "content": f"Question: {question}"}], tokenize=False,
        add_generation_prompt=True, enable_thinking=False,
    )
    if not full.startswith(context):
        raise ValueError("the chat template is not prefix-stable; the query cannot follow the context")
    return full[len(context):]


def build_episode(tokenizer, examples: Sequence[QAExample], *, max_doc_tokens: int = 32,
                  outdated_passages: int = 1) -> Episode:
    """Render one episode: task turn, then per question an outdated result and the result that supersedes it.

    Args:
        tokenizer: the model's tokenizer with a (prefix-stable) chat template.
        examples: the k source questions (k >= 1), in the order their outdated results are deleted.
        max_doc_tokens: per-passage token cap (whole sentences kept; >= 8).
        outdated_passages: distractor passages in each outdated result (>= 1).

    Raises:
        ValueError: naming ``examples`` when empty or an example lacks distractors, ``outdated_passages`` when < 1.
    """
    if not examples:
        raise ValueError("examples is empty; an episode needs at least one question")
    if outdated_passages < 1:
        raise ValueError(f"outdated_passages={outdated_passages} must be >= 1")
    messages = [{"role": "user", "content": TASK}]
    kinds = [("head", -1)]
    for i, ex in enumerate(examples):
        if len(ex.distractors) < outdated_passages:
            raise ValueError(f"examples[{i}] has {len(ex.distractors)} distractors; need {outdated_passages}")
        old = passage_block(tokenizer, ex.distractors[:outdated_passages], max_doc_tokens)
        new = passage_block(tokenizer, ex.supporting, max_doc_tokens)
        messages.append({"role": "user", "content": f"Tool output (search {i + 1}, outdated):\n{old}"})
        kinds.append(("outdated", i))
        messages.append({"role": "user", "content": f"Tool output (search {i + 1}, current):\n{new}"})
        kinds.append(("current", i))
    texts, context = _render_turns(tokenizer, messages)
    turns = tuple(Turn(t, kind, idx) for t, (kind, idx) in zip(texts, kinds))
    queries = tuple(_query_text(tokenizer, messages, ex.question, context) for ex in examples)
    return Episode(f"{examples[0].dataset}:{examples[0].id}", turns, queries, tuple(examples))


def build_episodes(tokenizer, pool: Sequence[QAExample], n_episodes: int, k: int, *, seed: int = 0,
                   max_doc_tokens: int = 32) -> list[Episode]:
    """``n_episodes`` episodes of ``k`` questions each, from one seeded selection of ``n_episodes * k`` sources.

    Raises:
        ValueError: naming ``k`` (outside [1, 10]) or ``n_episodes`` (< 1) or when the pool is too small.
    """
    if not 1 <= k <= 10:
        raise ValueError(f"k={k} must lie in [1, 10] (edits per episode)")
    if n_episodes < 1:
        raise ValueError(f"n_episodes={n_episodes} must be >= 1")
    usable = [ex for ex in pool if ex.distractors and ex.supporting]
    if len(usable) < n_episodes * k:
        raise ValueError(f"need n_episodes * k = {n_episodes * k} sources with distractors; the pool has {len(usable)}")
    sources = select_sources(usable, n_episodes * k, seed)
    return [build_episode(tokenizer, sources[e * k : (e + 1) * k], max_doc_tokens=max_doc_tokens)
            for e in range(n_episodes)]


def kv_relative_deviation(cache, reference) -> tuple[float, float]:
    """Relative Frobenius deviation of keys and of values over all layers and rows (float64).

    Returns:
        ``(‖K − K_ref‖_F / ‖K_ref‖_F, ‖V − V_ref‖_F / ‖V_ref‖_F)``.

    Raises:
        ValueError: naming ``cache`` when its shape differs from ``reference``'s.
    """
    num = {"k": 0.0, "v": 0.0}
    den = {"k": 0.0, "v": 0.0}
    for (k, v), (kr, vr) in zip(to_tensors(cache), to_tensors(reference)):
        if k.shape != kr.shape:
            raise ValueError(f"cache layer shape {tuple(k.shape)} differs from reference {tuple(kr.shape)}")
        for name, a, b in (("k", k, kr), ("v", v, vr)):
            b = b.double()
            num[name] += float((a.double() - b).pow(2).sum())
            den[name] += float(b.pow(2).sum())
    return (num["k"] / den["k"]) ** 0.5, (num["v"] / den["v"]) ** 0.5


def run_episode(lm: LoadedModel, episode: Episode, arms: Sequence[Arm], *, executor: str = "sequential",
                max_new_tokens: int = 8, seed: int = 0) -> list[dict]:
    """Follow one episode's k edits with every arm; one record per (edit, arm).

    All arms fork one prefill of the full context. After edit i (deleting outdated result i) each arm repairs with its
    policy, question i is answered (non-reference arms verify Re-prefill's answer as a draft: same greedy result, one
    forward when preserved) and the live cache is compared with Re-prefill's (a clean prefill of the same tokens).

    Returns:
        Records with ``episode, edit`` (1..k), ``arm, method, budget_pct, debt_pct, context_tokens, suffix_len,
        allowance, forwarded_tokens, refresh_ms, prediction, em, agree, token_exact, key_dev, value_dev, debt``.

    Raises:
        ValueError: naming ``arms`` when Re-prefill is missing or labels repeat.
    """
    sessions, rows_of = _start_arms(lm, episode, arms, executor=executor, seed=seed)
    ref_arm = next(a for a in arms if a.method == REFERENCE)
    order = [ref_arm] + [a for a in arms if a is not ref_arm]
    records = []
    removed = 0  # tokens of outdated results already deleted (all before the next one)
    for i, ex in enumerate(episode.examples):
        start, end = rows_of[i]
        start, end = start - removed, end - removed
        removed += end - start
        reference = None
        for arm in order:
            session = sessions[arm.label]
            session.set_query(episode.queries[i], question=ex.question)
            record = session.delete(start, end)
            if arm is ref_arm:
                answer = session.answer(max_new_tokens=max_new_tokens)
                reference = (answer, session.cache)
            else:
                answer = session.answer(max_new_tokens=max_new_tokens, draft=reference[0].token_ids)
            prediction = extract_answer(answer.text)
            ref_prediction = extract_answer(reference[0].text)
            key_dev, value_dev = kv_relative_deviation(session.cache, reference[1])
            records.append({
                "episode": episode.id, "edit": i + 1, "arm": arm.label, "method": arm.method,
                "budget_pct": arm.budget_pct, "debt_pct": arm.debt_pct, "context_tokens": record.num_tokens,
                "deleted_tokens": end - start, "suffix_len": record.suffix_len, "allowance": record.allowance,
                "forwarded_tokens": record.forwarded_tokens, "refresh_ms": record.refresh_ms,
                "select_ms": record.timings_ms["select"], "answer_ms": answer.timings_ms["answer"],
                "prediction": prediction, "em": bool(score_example(prediction, ex)),
                "agree": bool(agreement(prediction, ref_prediction)),
                "token_exact": answer.token_ids == reference[0].token_ids,
                "key_dev": key_dev, "value_dev": value_dev, "debt": session.debt,
                "debt_frac": session.debt / max(1, len(session)),
            })
    return records


def edit_token_view(lm: LoadedModel, episode: Episode, arms: Sequence[Arm], *, edit: int | None = None,
                    executor: str = "sequential", seed: int = 0):
    """The token view (:func:`sur_lab.analysis.plotting.token_view`) of one edit of an episode, under every arm.

    The episode is replayed up to edit ``edit`` exactly as :func:`run_episode` does (same forks, same edits, no
    answers). The view shows the live context right before that edit with the deleted outdated result struck
    through, each arm's recomputed rows (the edit's repair and, for a debt arm, the stale rows it refreshed anywhere
    in the context) and each row's K/V deviation from Re-prefill's cache after the edit. Relevance and units are
    those of the first SUR arm's selection (none without one).

    Args:
        lm, episode, arms: as for :func:`run_episode`.
        edit: the edit shown, 1..k (default: the last, where staleness has accumulated most).
        executor, seed: as for :func:`run_episode`.

    Returns:
        The :class:`~sur_lab.analysis.plotting.TokenView`.

    Raises:
        ValueError: naming ``edit`` outside [1, k], or ``arms`` as :func:`run_episode` does.
    """
    k = episode.k
    edit = k if edit is None else edit
    if not 1 <= edit <= k:
        raise ValueError(f"edit={edit} must lie in [1, {k}] (the episode's edits)")
    sessions, rows_of = _start_arms(lm, episode, arms, executor=executor, seed=seed)
    removed, records, before = 0, {}, None
    for i in range(edit):
        start, end = rows_of[i]
        start, end = start - removed, end - removed
        removed += end - start
        for arm in arms:
            session = sessions[arm.label]
            if i == edit - 1 and before is None:
                before = session.tokens
            session.set_query(episode.queries[i], question=episode.examples[i].question)
            records[arm.label] = session.delete(start, end)
    reference = sessions[next(a.label for a in arms if a.method == REFERENCE)].cache
    refreshed = {(a.method, None if np.isnan(a.budget_pct) else a.budget_pct) if a.debt_pct == 0 else a.label:
                 records[a.label].refreshed_rows for a in arms}
    keys = dict(zip([a.label for a in arms], refreshed))
    deviation = {keys[a.label]: row_deviation(sessions[a.label].cache, reference) for a in arms}
    sur = next((records[a.label].selection for a in arms if a.method == "SUR" and records[a.label].selection), None)
    diag = sur.diagnostics if sur is not None else {}
    last = records[arms[0].label]
    return token_view(token_pieces(lm.tokenizer, before), prefix_len=last.start, deleted_len=last.end - last.start,
                      refreshed=refreshed, relevance=diag.get("token_scores"), units=diag.get("units", ()),
                      deviation=deviation, query=episode.queries[edit - 1],
                      title=f"episode {episode.id}, edit {edit} of {k}: outdated result {edit} deleted")


def _start_arms(lm: LoadedModel, episode: Episode, arms: Sequence[Arm], *, executor: str, seed: int):
    """One prefill of the episode's turns forked into one session per arm; returns ``(sessions by label, row span
    of each outdated result)``.

    Raises:
        ValueError: naming ``arms`` when Re-prefill is missing or labels repeat.
    """
    labels = [a.label for a in arms]
    if REFERENCE not in [a.method for a in arms] or len(set(labels)) != len(labels):
        raise ValueError(f"arms must have unique labels and include {REFERENCE!r}; got {labels}")
    base = EditSession(lm, method="Shift", executor=executor, seed=seed)
    for turn in episode.turns:
        base.append(turn.text)
    sessions = {a.label: base.fork(method=a.method, budget_pct=0.0 if np.isnan(a.budget_pct) else a.budget_pct,
                                   debt_pct=a.debt_pct) for a in arms}
    return sessions, _turn_rows(base, episode)


def _turn_rows(session: EditSession, episode: Episode) -> list[tuple[int, int]]:
    """Row span of each outdated result, from the append records (one record per turn)."""
    spans = {}
    for turn, record in zip(episode.turns, session.history):
        if turn.kind == "outdated":
            spans[turn.index] = (record.start, record.end)
    return [spans[i] for i in range(episode.k)]


def run_episodes(lm: LoadedModel, episodes: Sequence[Episode], arms: Sequence[Arm], *, executor: str = "sequential",
                 max_new_tokens: int = 8, seed: int = 0, out: Path | str | None = None,
                 progress: bool = True) -> pd.DataFrame:
    """:func:`run_episode` over ``episodes``; returns one DataFrame with cumulative cost columns per arm.

    Added columns: ``cum_forwarded_tokens`` and ``cum_refresh_ms`` (sums over the episode's edits so far) and
    ``cost_ratio`` (cumulative forwarded tokens over Re-prefill's in the same episode).

    Args:
        lm, arms, executor, max_new_tokens, seed: as :func:`run_episode`.
        episodes: the episodes (ids unique).
        out: a folder to store the rows in and resume from (:meth:`sur_lab.sweeps.SweepStore.run_keyed`: an episode
            is a case, its rows keyed by ``(edit, arm)``, the table :data:`TABLE_FILE`; an episode stored with another
            model, dtype, device, arms, executor, ``max_new_tokens``, seed, versions or content is refused). ``None``:
            nothing is stored.
        progress: a progress bar.

    Raises:
        ValueError: naming ``episodes`` when empty or an id repeats; as :func:`run_episode`; with ``out``, naming the
            folder, the episode and the first differing field when a stored episode was made with another fingerprint.
    """
    ids = [episode.id for episode in episodes]
    if not ids or len(set(ids)) != len(ids):
        raise ValueError(f"episodes must be non-empty with unique ids; got {len(ids)} episodes, {len(set(ids))} "
                         "distinct ids")

    def rows_of(episode: Episode) -> list[dict]:
        return run_episode(lm, episode, arms, executor=executor, max_new_tokens=max_new_tokens, seed=seed)

    if out is None:
        return add_cumulative(pd.DataFrame([row for episode in tqdm(episodes, desc="episodes", disable=not progress)
                                            for row in rows_of(episode)]))

    fp = {**model_fingerprint(lm), "arms": digest({"arms": [asdict(a) for a in arms]}), "executor": executor,
          "max_new_tokens": int(max_new_tokens), "seed": int(seed), "versions": versions()}
    return SweepStore(out).run_keyed(
        dict(zip(ids, episodes)), rows_of, key=("edit", "arm"), fingerprint=fp,
        case_fingerprint=lambda e: {"episode": digest({"episode": asdict(e)})}, table=TABLE_FILE,
        finish=add_cumulative, progress=progress, desc="episodes")


def add_cumulative(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` (:func:`run_episode` rows) with ``cum_forwarded_tokens``, ``cum_refresh_ms`` and ``cost_ratio`` (see
    :func:`run_episodes`)."""
    df = df.copy()
    grouped = df.groupby(["episode", "arm"], sort=False)
    df["cum_forwarded_tokens"] = grouped["forwarded_tokens"].cumsum()
    df["cum_refresh_ms"] = grouped["refresh_ms"].cumsum()
    ref = df[df["arm"] == REFERENCE].set_index(["episode", "edit"])["cum_forwarded_tokens"]
    df["cost_ratio"] = df["cum_forwarded_tokens"].to_numpy() / ref.loc[list(zip(df["episode"], df["edit"]))].to_numpy()
    return df


# ---------------------------------------------------------------------------------------------------------------------
# Tables and figures


def per_edit_table(df: pd.DataFrame) -> pd.DataFrame:
    """Means per (arm, edit index) over episodes: EM and agreement (%), cumulative cost, deviation, debt."""
    out = df.groupby(["arm", "edit"], sort=False).agg(
        n=("em", "size"), em_pct=("em", "mean"), agree_pct=("agree", "mean"),
        token_exact_pct=("token_exact", "mean"), cum_forwarded_tokens=("cum_forwarded_tokens", "mean"),
        cum_refresh_ms=("cum_refresh_ms", "mean"), cost_ratio=("cost_ratio", "mean"), key_dev=("key_dev", "mean"),
        value_dev=("value_dev", "mean"), debt_frac=("debt_frac", "mean"),
    ).reset_index()
    for col in ("em_pct", "agree_pct", "token_exact_pct"):
        out[col] *= 100
    return out


def summary_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per arm over all edits: EM, agreement and token-exact (%), total cost against Re-prefill, last-edit deviation."""
    last = df["edit"] == df.groupby("episode")["edit"].transform("max")
    total = df[last].groupby("arm", sort=False).agg(
        total_forwarded_tokens=("cum_forwarded_tokens", "mean"), total_refresh_ms=("cum_refresh_ms", "mean"),
        cost_ratio=("cost_ratio", "mean"), final_key_dev=("key_dev", "mean"), final_value_dev=("value_dev", "mean"),
        final_debt_frac=("debt_frac", "mean"),
    )
    quality = df.groupby("arm", sort=False).agg(
        n=("em", "size"), em_pct=("em", "mean"), agree_pct=("agree", "mean"), token_exact_pct=("token_exact", "mean"),
    )
    quality[["em_pct", "agree_pct", "token_exact_pct"]] *= 100
    return quality.join(total).reset_index()


def lead_arm(arms: Sequence[Arm]) -> Arm | None:
    """The per-edit SUR arm that :data:`REPREFILL_FAMILY` compares with Re-prefill: the one at the debt arm's budget
    (the arm the primary compares the debt arm with), else the one at :data:`LEAD_BUDGET` when it ran, else the first
    per-edit budget's; ``None`` when no per-edit budgeted arm ran."""
    plain = {a.budget_pct: a for a in arms if a.method not in ("Shift", REFERENCE) and a.debt_pct == 0}
    debt = [a.budget_pct for a in arms if a.debt_pct > 0][:1]
    for budget in (*debt, LEAD_BUDGET):
        if budget in plain:
            return plain[budget]
    return next(iter(plain.values()), None)


def decide_families(df: pd.DataFrame, arms: Sequence[Arm], *, decide: bool = True, n_boot: int = 10_000,
                    seed: int = 0) -> pd.DataFrame:
    """Notebook 07's declared comparisons (:data:`PRIMARY` when a debt arm ran, :data:`REPREFILL_FAMILY` with its
    margin, :data:`BUDGET_FAMILY`, in this order), decided by :func:`sur_lab.analysis.decisions.paired_family` on
    agreement with Re-prefill, one unit per (episode, edit), the episodes clustered.

    Args:
        df: :func:`run_episodes` rows.
        arms: the arms that ran (:func:`default_arms`).
        decide: ``False`` at a plumbing-check size (``decisions.decides(preset)``): every verdict "not decided".
        n_boot, seed: as :func:`~sur_lab.analysis.decisions.paired_family`.

    Returns:
        The families' rows (``family`` names each); empty when no comparison ran.
    """
    data = df.assign(_unit=df["episode"].astype(str) + "/" + df["edit"].astype(str), _a=df["agree"].astype(float))
    debt = [a for a in arms if a.debt_pct > 0]
    plain = {a.budget_pct: a for a in arms if a.method not in ("Shift", REFERENCE) and a.debt_pct == 0}
    lead = lead_arm(arms)
    wanted = {PRIMARY: [(d.label, plain[d.budget_pct].label) for d in debt[:1] if d.budget_pct in plain],
              REPREFILL_FAMILY: [(lead.label, REFERENCE)] if lead is not None else [],
              BUDGET_FAMILY: [(a.label, "Shift") for a in plain.values()]}
    parts = []
    for fam, pairs in wanted.items():
        outcomes, clusters = paired_outcomes(data, pairs, "_a", arm_col="arm", case_col="_unit", cluster_col="episode")
        if outcomes:
            parts.append(paired_family(outcomes, family=fam, cluster=clusters, decide=decide, n_boot=n_boot, seed=seed))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=COLUMNS)


def conclusion(decided: pd.DataFrame) -> list[str]:
    """The verdict lines of notebook 07's conclusion: each family of :func:`decide_families` with its size, then each
    comparison (:func:`sur_lab.analysis.decisions.sentence`)."""
    return family_lines(decided, what="questions", clusters="episodes")


def _arm_styles(arms: Sequence[str]) -> dict:
    return {arm: {"color": f"C{i}", "marker": "os^vDP*X"[i % 8]} for i, arm in enumerate(arms)}


def plot_quality_per_edit(table: pd.DataFrame):
    """Agreement with Re-prefill (left) and EM (right) per edit index, one line per arm."""
    arms = list(dict.fromkeys(table["arm"]))
    style = _arm_styles(arms)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharex=True)
    panels = ((axes[0], "agree_pct", "answer agreement with Re-prefill (%)"), (axes[1], "em_pct", "EM (%)"))
    for ax, col, label in panels:
        for arm in arms:
            t = table[table["arm"] == arm]
            ax.plot(t["edit"], t[col], label=arm, lw=1.4, ms=5, **style[arm])
        ax.set_xlabel("edit index (outdated results deleted so far)")
        ax.set_ylabel(label)
        ax.set_ylim(-3, 103)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


def plot_cumulative_cost(table: pd.DataFrame):
    """Cumulative tokens forwarded (left) and cumulative repair time (right) per edit index, on a symmetric log scale
    (logarithmic above one token or one ms, linear below it): Shift forwards nothing, and its zero is drawn at 0, not
    clipped to a made-up small value."""
    arms = list(dict.fromkeys(table["arm"]))
    style = _arm_styles(arms)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharex=True)
    for ax, col, label in ((axes[0], "cum_forwarded_tokens", "cumulative tokens forwarded"),
                           (axes[1], "cum_refresh_ms", "cumulative repair time (ms, shared CPU)")):
        for arm in arms:
            t = table[table["arm"] == arm]
            ax.plot(t["edit"], t[col], label=arm, lw=1.4, ms=5, **style[arm])
        ax.set_yscale("symlog", linthresh=1.0)  # 0 (Shift) stays 0; counts and ms >= 1 on a log scale
        ax.set_ylim(bottom=-0.3)  # the zero line just above the frame
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("edit index")
        ax.set_ylabel(label)
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


def plot_staleness(table: pd.DataFrame):
    """Key / value deviation from a clean prefill and the stale-row fraction per edit index (Re-prefill omitted)."""
    arms = [a for a in dict.fromkeys(table["arm"]) if a != REFERENCE]
    style = _arm_styles(list(dict.fromkeys(table["arm"])))
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8), sharex=True)
    for ax, col, label in ((axes[0], "key_dev", "relative key deviation"),
                           (axes[1], "value_dev", "relative value deviation"),
                           (axes[2], "debt_frac", "stale rows (fraction of context)")):
        for arm in arms:
            t = table[table["arm"] == arm]
            ax.plot(t["edit"], t[col], label=arm, lw=1.4, ms=5, **style[arm])
        ax.set_xlabel("edit index")
        ax.set_ylabel(label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[2].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


def plot_cost_quality(summary: pd.DataFrame):
    """Agreement with Re-prefill against total cost relative to Re-prefill (tokens forwarded), one point per arm, on a
    symmetric log axis (linear below 0.1 %, so Shift's zero cost is drawn at 0)."""
    style = _arm_styles(list(summary["arm"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    for _, row in summary.iterrows():
        ax.scatter(row["cost_ratio"], row["agree_pct"], s=60, label=row["arm"], **style[row["arm"]])
    ax.set_xscale("symlog", linthresh=1e-3)
    ax.set_xlim(left=-3e-4)  # Shift's zero cost just right of the frame
    ax.set_xlabel("tokens forwarded / Re-prefill's (symlog: linear below 0.001)")
    ax.set_ylabel("agreement with Re-prefill (%)")
    ax.set_ylim(-3, 103)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig
