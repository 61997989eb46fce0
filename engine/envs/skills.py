"""Skill banks and the privileged teacher prompt (ALGORITHM.md §1.4).

Legend: M = turn rows, Lp = student prompt length (left-padded), Lt = teacher prompt length
(= max_prompt_length, left-padded).

A skill bank lives in ``<env>/skills/`` beside the environment (or in ``<root>/<env>/`` of a run's own banks):
``skill_mapping.json`` with

* ``skill_files``: skill name -> markdown file (``general_skills`` is the general skill);
* ``task_to_skill``: task type -> skill name (its order is the lookup order);
* ``task_keywords``: task type -> keywords for the keyword fallback;

plus the markdown files. Lookup for one row (§1.4, reconstructed from SDAR's skill provider):

1. with a gamefile (ALFWorld): the first task type, in mapping order, whose name is a substring of the
   gamefile path;
2. otherwise (also when step 1 found nothing), by data_source: ``popqa`` -> entity_attribute_lookup;
   ``nq``/``triviaqa`` -> direct_retrieval; ``hotpotqa`` -> multi_hop_reasoning; else, if the prompt
   contains "which" and "or" but not "for" -> compare; ``2wikimultihopqa``/``musique``/``bamboogle`` ->
   multi_hop_reasoning. If nothing matched and the data_source is ``"text"``, keyword matching:
3. every task type with any keyword in the lower-cased decoded prompt, in mapping order.

Skill text = general skill + matched skills, joined by a blank line (``skill_all``: every skill).
Teacher prompt text = ``"[Privileged Skill Information]\\n" + skill_text + "\\n\\n" + decoded student
prompt`` (decoded with special tokens kept), re-tokenised without special tokens, left-truncated to
``max_prompt_length`` (the skill text goes first), left-padded.

A control (``skill_withheld``, ``alignopsd ablate --withhold-skill K``; not the paper's method): the last K siblings
of every task get the general skill only, so the teacher's own grade of their turns is uninformed.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from alignopsd.engine.envs.registry import get_entry
from torch import Tensor

GENERAL = "general_skills"
HEADER = "[Privileged Skill Information]\n"
_DATA_SOURCE_SKILL = {
    "popqa": "entity_attribute_lookup",
    "nq": "direct_retrieval",
    "triviaqa": "direct_retrieval",
    "hotpotqa": "multi_hop_reasoning",
}
_MULTI_HOP = ("2wikimultihopqa", "musique", "bamboogle")


@dataclass(frozen=True)
class SkillBank:
    """A loaded skill bank (see module docstring)."""

    env: str
    skills: dict[str, str]  # skill name -> text (stripped markdown)
    task_to_skill: dict[str, str]
    task_keywords: dict[str, list[str]]

    @property
    def general(self) -> str:
        return self.skills.get(GENERAL, "")

    def match(self, gamefile: str | None = None, data_source: str | None = None, prompt: str = "") -> list[str]:
        """Matched task types for one row, by the §1.4 lookup order."""
        if gamefile:
            for task in self.task_to_skill:
                if task in gamefile:
                    return [task]
        low = (prompt or "").lower()
        if data_source:
            ds = data_source.lower()
            skill: str | None = None
            if ds in _DATA_SOURCE_SKILL:
                skill = _DATA_SOURCE_SKILL[ds]
            elif "which" in low and "or" in low and "for" not in low:
                skill = "compare"
            elif ds in _MULTI_HOP:
                skill = "multi_hop_reasoning"
            if skill is not None:
                tasks = [t for t, s in self.task_to_skill.items() if s == skill or t == skill]
                if tasks:
                    return tasks[:1]
            if ds != "text":
                return []
        return [t for t, kws in self.task_keywords.items() if t in self.task_to_skill and any(k in low for k in kws)]

    def skill_text(
        self, gamefile: str | None = None, data_source: str | None = None, prompt: str = "", skill_all: bool = False
    ) -> str:
        """General skill + matched task skills, joined by a blank line."""
        if skill_all:
            names = [n for n in self.skills if n != GENERAL]
        else:
            names = []
            for t in self.match(gamefile, data_source, prompt):
                name = self.task_to_skill[t]
                if name not in names:
                    names.append(name)
        parts = [self.general] if self.general else []
        parts += [self.skills[n] for n in names if n in self.skills]
        return "\n\n".join(parts)


_CACHE: dict[tuple[str, str], SkillBank] = {}


def bank_folder(env: str, root: str | os.PathLike | None = None) -> Path:
    """The folder of ``env``'s skill bank: ``<root>/<env>/``, or the packaged one, the ``skills/`` folder of its
    registry entry's ``skills`` package (an environment without one has no packaged bank: a folder that is not)."""
    if root is not None:
        return Path(root) / env
    package = get_entry(env).skills
    if package is None:
        return Path(os.devnull) / env
    return Path(importlib.import_module(package).__file__).resolve().parent / "skills"


def load_skill_bank(env: str, root: str | os.PathLike | None = None) -> SkillBank:
    """Load ``<root>/<env>/skill_mapping.json`` and its markdown files (root: the packaged skills)."""
    folder = bank_folder(env, root)
    key = (str(folder), env)
    if key in _CACHE:
        return _CACHE[key]
    mapping_path = folder / "skill_mapping.json"
    if not mapping_path.is_file():
        raise ValueError(f"env: no skill bank at {mapping_path}")
    mapping = json.loads(mapping_path.read_text())
    for k in ("skill_files", "task_to_skill"):
        if not isinstance(mapping.get(k), dict):
            raise ValueError(f"{mapping_path}: '{k}' must be an object")
    skills: dict[str, str] = {}
    for name, fname in mapping["skill_files"].items():
        path = folder / fname
        if not path.is_file():
            raise ValueError(f"{mapping_path}: skill file {fname!r} of {name!r} not found")
        skills[name] = path.read_text().strip()
    for task, name in mapping["task_to_skill"].items():
        if name not in skills:
            raise ValueError(f"{mapping_path}: task {task!r} maps to unknown skill {name!r}")
    keywords = {t: [str(k).lower() for k in v] for t, v in mapping.get("task_keywords", {}).items()}
    bank = SkillBank(env, skills, dict(mapping["task_to_skill"]), keywords)
    _CACHE[key] = bank
    return bank


def skill_lookup(
    env: str, root: str | os.PathLike | None = None, skill_all: bool = False
) -> Callable[[dict[str, Any]], str] | None:
    """Row metadata -> skill text for ``env`` (None when ``env`` has no skill bank).

    The row dict may carry ``gamefile``, ``data_source`` and ``prompt_text`` (the decoded student prompt,
    used by the keyword and "which ... or" rules).
    """
    if not (bank_folder(env, root) / "skill_mapping.json").is_file():
        return None
    bank = load_skill_bank(env, root)

    def lookup(row: dict[str, Any]) -> str:
        return bank.skill_text(row.get("gamefile"), row.get("data_source"), row.get("prompt_text") or "", skill_all)

    return lookup


def skill_withheld(lookup: Callable[[dict[str, Any]], str], general: str, group_n: int, withheld: int):
    """A control, not the paper's method: ``lookup`` for the first ``group_n - withheld`` siblings of every task and,
    for the last ``withheld`` (sibling index ``rollout`` >= ``group_n - withheld``), the ``general`` skill only, what
    a bank gives a task it has no skill for (the teacher is not told the task's rule on those siblings)."""
    for name, v in (("group_n", group_n), ("withheld", withheld)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name}: expected an int, got {v!r}")
    if not 1 <= withheld <= group_n:
        raise ValueError(f"withheld: expected 1 to group_n ({group_n}) siblings, got {withheld}")

    def lookup_withheld(row: dict[str, Any]) -> str:
        k = row.get("rollout")
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < group_n:
            raise ValueError(f"skill lookup: the row's sibling index 'rollout' must be in [0, {group_n}), got {k!r}")
        return general if k >= group_n - withheld else lookup(row)

    return lookup_withheld


def teacher_prompt_text(skill_text: str, decoded_student_prompt: str) -> str:
    """§1.4 step 3: the skill block placed before the whole chat-formatted student prompt."""
    return HEADER + skill_text + "\n\n" + decoded_student_prompt


def decode_student_prompts(tokenizer: Any, prompt_ids_MLp: Tensor, prompt_mask_MLp: Tensor) -> list[str]:
    """§1.4 step 1: each prompt from its first non-pad position, decoded with special tokens kept."""
    if prompt_ids_MLp.dim() != 2 or prompt_ids_MLp.shape != prompt_mask_MLp.shape:
        raise ValueError(
            f"student_prompt_mask: expected the shape of student_prompt_ids {tuple(prompt_ids_MLp.shape)}, "
            f"got {tuple(prompt_mask_MLp.shape)}"
        )
    out = []
    for ids, mask in zip(prompt_ids_MLp.tolist(), prompt_mask_MLp.tolist()):
        start = next((i for i, m in enumerate(mask) if m), len(mask))
        out.append(tokenizer.decode(ids[start:], skip_special_tokens=False))
    return out


def build_teacher_prompts(
    tokenizer: Any,
    student_prompt_ids: Tensor,
    student_prompt_mask: Tensor,
    skill_texts: Sequence[str],
    max_prompt_length: int,
    pad_id: int,
) -> tuple[Tensor, Tensor, int]:
    """Teacher prompts of §1.4 steps 1-6.

    Args:
        student_prompt_ids: [M, Lp] long, left-padded student prompts (chat template applied).
        student_prompt_mask: [M, Lp] 0/1 (or bool), 0 on padding.
        skill_texts: M skill texts (see SkillBank.skill_text).
        max_prompt_length: Lt, the teacher prompt width.
        pad_id: padding id.

    Returns:
        (ids [M, Lt] long, mask [M, Lt] long, number of rows that were left-truncated).
    """
    if not isinstance(max_prompt_length, int) or max_prompt_length <= 0:
        raise ValueError(f"max_prompt_length: expected a positive int, got {max_prompt_length!r}")
    m = student_prompt_ids.shape[0] if student_prompt_ids.dim() == 2 else -1
    if len(skill_texts) != m:
        raise ValueError(f"skill_texts: expected {m} texts (one per student prompt row), got {len(skill_texts)}")
    decoded = decode_student_prompts(tokenizer, student_prompt_ids, student_prompt_mask)
    ids_MLt = torch.full((m, max_prompt_length), int(pad_id), dtype=torch.long)
    mask_MLt = torch.zeros((m, max_prompt_length), dtype=torch.long)
    truncated = 0
    for i, (skill, text) in enumerate(zip(skill_texts, decoded)):
        toks = tokenizer(teacher_prompt_text(skill, text), add_special_tokens=False)["input_ids"]
        if len(toks) > max_prompt_length:
            toks = toks[-max_prompt_length:]
            truncated += 1
        if toks:
            ids_MLt[i, max_prompt_length - len(toks) :] = torch.tensor(toks, dtype=torch.long)
            mask_MLt[i, max_prompt_length - len(toks) :] = 1
    return ids_MLt, mask_MLt, truncated
