"""The reader: the credit benchmark's tiny model trained, before any RL, to follow the rule its skill block states.

Recipe (:data:`RECIPE`; the cache key hashes it with the source of this module and of the task families). A
recipe's ``family`` names the tasks it reads (:data:`FAMILIES`; default ``credit_rules``, whose terms follow;
``credit_drift``, bench/credit_drift.py, the same with its own kinds, variants and skills):

* tokenizer: the engine's byte-level BPE trained on the ``credit`` corpus (bench/credit_model.py) plus the
  ``credit_rules`` episodes' student and teacher prompts and every variant's skill text, so each word is a token;
* model: the engine's tiny Llama shape (hidden 64) with ``layers`` layers of ``heads`` attention heads, sized to
  that vocabulary, from a fixed seed (four heads of 16 dimensions instead of two of 32: the same cost);
* data: random-action episodes of ``credit_rules`` tasks (split ``reader``, never the benchmark's tasks), the
  rule variant of each episode drawn at random (every variant of every kind, bench/credit_rules.py). From every
  episode, every decisive turn and one corridor turn, each in both views: the teacher's (the skill block stating
  the episode's variant before the chat-formatted prompt, exactly as the engine builds teacher prompts) and the
  student's (no skill). The target response is one of the turn's two candidate texts (the candidate-choice
  backend's, plus EOS). In the teacher's view it is the action the variant states (at the bridge of ``agree``
  whatever the mark); where the rule states none (corridor turns) an admissible action drawn at random. In the
  student's view of a turn whose action the rule states, the deciding token's target is the uniform distribution
  over the turn's actions (the student cannot know the variant; a sampled target, as the first recipe had, left
  the tiny model with a preference for some words, 0.41 for the benchmark's code word instead of 0.25).
* training: next-token cross-entropy on the response tokens only, the token that decides between the turn's
  actions (the first one where the target differs from another action's candidate of the same phrasing) weighted
  ``focus_weight`` times the others (it is one token of ~15, the rest are format and copy), AdamW with a linear
  warm-up and a linear decay to a tenth, fixed batch order (seeded).

:func:`ensure_reader` keeps the result in the engine's cache folder (``<cache>/bench/credit-reader-<hash>``, built
once, atomically) and trusts a cached folder only after checking it: the manifest's checksums of every file and
the recipe stored with it (a corrupt, incomplete or foreign folder is moved aside and rebuilt).
:func:`decisive_choice` measures the premise: the policy's probability of the winning action on decisive turns,
with and without the skill, scored exactly as the candidate-choice backend samples.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import random
import shutil
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from bench import credit_rules as rules

# The task families a reader can be trained for (the recipe's ``family``; absent: ``credit_rules``). A family
# module has KINDS, VARIANTS, GENERAL, skill_text(kind, variant), make_task(kind, variant, split, seed, i),
# load_tasks(split, n, seed, rule), an environment whose instances answer rule_action() and winning_action() for
# their current state, and the prompt builder (``new_env``/``prompt`` below look them up).
FAMILIES = {"credit_rules": "bench.credit_rules", "credit_drift": "bench.credit_drift"}

RECIPE: dict[str, Any] = {
    "version": 3,
    "seed": 0,
    "init_range": 0.02,
    "layers": 2,
    "heads": 4,
    "episodes": 2400,
    "corridor_per_episode": 1,
    "steps": 1400,
    "batch": 32,
    "lr": 5e-3,
    "weight_decay": 0.0,
    "warmup": 50,
    "focus_weight": 10.0,
}
RECIPE_FILE = "reader_recipe.json"
LENGTH_PARTS = 2  # sub-batches of a training step, by length (measured: 2 beat 1, 4 and 8)


def family(recipe: dict[str, Any] | str | None = None) -> ModuleType:
    """The task family module of a recipe (or of a family's name); ``credit_rules`` by default."""
    name = recipe if isinstance(recipe, str) else (recipe or {}).get("family", "credit_rules")
    if name not in FAMILIES:
        raise ValueError(f"family: expected one of {sorted(FAMILIES)}, got {name!r}")
    return importlib.import_module(FAMILIES[name])


def new_env(fam: ModuleType):
    return fam.DriftEnv() if hasattr(fam, "DriftEnv") else fam.RuleEnv()


def prompt_builder(fam: ModuleType):
    if hasattr(fam, "drift_prompt"):
        return fam.drift_prompt()
    from alignopsd.engine.envs.credit.env import credit_prompt

    return credit_prompt()


def recipe_key(recipe: dict[str, Any] | None = None) -> str:
    """Hash of the recipe and of the code that applies it (16 hex digits)."""
    here = Path(__file__).resolve().parent
    h = hashlib.sha256(json.dumps(recipe or RECIPE, sort_keys=True).encode())
    for name in ("credit_reader.py", "credit_rules.py", "credit_model.py", "credit_drift.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


def _bank_skill(kind: str, variant: Any, fam: ModuleType = rules) -> str:
    """The skill text the engine's bank lookup gives a prompt of ``kind`` (general rule + the kind's rule)."""
    return fam.GENERAL.strip() + "\n\n" + fam.skill_text(kind, variant).strip()


def episode_turns(task, rng: random.Random, fam: ModuleType = rules) -> list[dict[str, Any]]:
    """Every turn of one random-action episode: user text, admissible actions, the action the rule states
    (``rule``) and the action that still wins (``win``; None where the rule leaves the turn free, and where an
    earlier choice already lost, e.g. the bridge of ``agree`` after a wrong mark)."""
    from alignopsd.engine.envs.prompts import PromptContext

    builder, env = prompt_builder(fam), new_env(fam)
    obs, info = env.reset(task, 0)
    history: list[tuple[str, str]] = []
    out, done = [], False
    while not done:
        acts = info["admissible_actions"]
        user = builder.render(PromptContext(info["task"], obs, acts, history, info))
        win, rule = env.winning_action(), env.rule_action()
        out.append({"user": user, "actions": acts, "win": win, "rule": rule, "decisive": rule is not None})
        action = rng.choice(acts)
        res = env.step(action)
        history.append((obs, action))
        obs, info, done = res.observation, res.info, res.done
    return out


def _random_task(rng: random.Random, i: int, fam: ModuleType = rules):
    kind = fam.KINDS[i % len(fam.KINDS)]
    variant = rng.choice(fam.VARIANTS[kind])
    return fam.make_task(kind, variant, "reader", 0, i), variant


def prompt_texts(tok, task, turn: dict[str, Any], variant: Any, fam: ModuleType = rules) -> tuple[str, str]:
    """(student prompt, teacher prompt) of one turn, chat-formatted as the engine builds them."""
    from alignopsd.engine.envs.prompts import chat_text
    from alignopsd.engine.envs.skills import teacher_prompt_text

    student = chat_text(tok, turn["user"])
    return student, teacher_prompt_text(_bank_skill(task.category, variant, fam), student)


def corpus_lines(recipe: dict[str, Any]) -> list[str]:
    """Extra tokenizer text: every variant's skill and a few rule episodes' prompts and candidates."""
    from alignopsd.engine.generation.choice import candidate_texts

    from bench.credit_model import corpus

    fam = family(recipe)
    lines = [fam.GENERAL, *corpus()]
    lines += [fam.skill_text(k, v) for k in fam.KINDS for v in fam.VARIANTS[k]]
    rng = random.Random(recipe["seed"])
    for i in range(24):
        task, _ = _random_task(rng, i, fam)
        for t in episode_turns(task, rng, fam):
            lines += [t["user"], *candidate_texts(t["user"])]
    return lines


def _focus(target: list[int], others: list[list[int]]) -> int:
    """The first position where ``target`` differs from one of ``others`` that shares all tokens before it (the
    token that decides between the turn's actions; -1: none)."""
    for j, tid in enumerate(target):
        if any(len(o) > j and o[:j] == target[:j] and o[j] != tid for o in others):
            return j
    return -1


def examples(tok, recipe: dict[str, Any]) -> list[tuple[list[int], list[int], int, list[int]]]:
    """(prompt ids, target response ids, position of the deciding token in the response, the deciding token of
    every action of the turn where the target there is uniform over them, else empty) of the recipe (see the
    module docstring): the student view of a turn whose action the rule fixes learns the uniform choice."""
    from alignopsd.engine.generation.choice import candidate_texts

    fam = family(recipe)
    rng = random.Random(recipe["seed"] + 1)
    texts: list[tuple[str, str, list[str], bool]] = []
    for i in range(recipe["episodes"]):
        task, variant = _random_task(rng, i, fam)
        turns = episode_turns(task, rng, fam)
        corridor = [t for t in turns if not t["decisive"]]
        chosen = [t for t in turns if t["decisive"]] + rng.sample(corridor, recipe["corridor_per_episode"])
        for t in chosen:
            cands = candidate_texts(t["user"])
            k = rng.randrange(2)  # the phrasing: candidates come in (i will a, a looks good) pairs
            for view, prompt in zip(("student", "teacher"), prompt_texts(tok, task, t, variant, fam)):
                uniform = view == "student" and t["rule"] is not None
                act = t["rule"] if t["rule"] and not uniform else rng.choice(t["actions"])
                target = [c for c in cands if c.endswith(f"<action>{act}</action>")][k]
                texts.append((prompt, target, [c for c in cands[k::2] if c != target], uniform))
    ids_p = tok([x[0] for x in texts], add_special_tokens=False)["input_ids"]
    ids_r = tok([x[1] for x in texts], add_special_tokens=False)["input_ids"]
    cache: dict[str, list[int]] = {}
    out = []
    for p, r, (_, _, others, uniform) in zip(ids_p, ids_r, texts):
        miss = [o for o in others if o not in cache]
        if miss:
            cache.update(zip(miss, tok(miss, add_special_tokens=False)["input_ids"]))
        focus = _focus(r, [cache[o] for o in others])
        alts = sorted({r[focus], *(cache[o][focus] for o in others)}) if uniform and focus >= 0 else []
        out.append((p, r + [tok.eos_token_id], focus, alts))
    return out


def build_tokenizer(recipe: dict[str, Any]):
    from alignopsd.engine.models.loading import build_bpe_tokenizer

    from bench.credit_model import VOCAB_LIMIT

    return build_bpe_tokenizer(corpus_lines(recipe), vocab_size=VOCAB_LIMIT)


def _rows(data, rows: list[int], pad_id: int, focus_weight: float):
    """Right-padded token ids of the examples ``rows``, the loss weight of each position (position t predicts
    token t + 1), the positions that carry a loss and the uniform targets' (row, position, deciding tokens)."""
    import torch

    width = max(len(data[i][0]) + len(data[i][1]) for i in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    weight = torch.zeros(len(rows), width)
    soft = []
    for j, i in enumerate(rows):
        p, r, focus, alts = data[i]
        ids[j, : len(p) + len(r)] = torch.tensor(p + r)
        weight[j, len(p) - 1 : len(p) + len(r) - 1] = 1.0
        if focus >= 0:
            weight[j, len(p) - 1 + focus] = 0.0 if alts else focus_weight
        if alts:
            soft.append((j, len(p) - 1 + focus, alts))
    keep = weight[:, :-1] > 0
    for j, pos, _ in soft:
        keep[j, pos] = True
    return ids, weight, keep, soft


def train(model, data: list[tuple[list[int], list[int], int, list[int]]], recipe: dict[str, Any], pad_id: int):
    """Supervised next-token training on the response tokens, the token that decides between the turn's actions
    weighted ``focus_weight`` times the others (against the uniform choice among the turn's actions where the
    example says so); the loss of every step."""
    import torch

    gen = torch.Generator().manual_seed(recipe["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], weight_decay=recipe["weight_decay"])
    warm, steps = max(1, recipe["warmup"]), recipe["steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warm, max(0.1, (steps - s) / steps)))
    model.train()
    losses = []
    for _ in range(steps):
        idx = torch.randint(len(data), (recipe["batch"],), generator=gen).tolist()
        # the batch's rows by length, in parts each padded to its own longest row (rows do not interact, and right
        # padding is causally invisible to the positions that carry a loss, so no attention mask is needed)
        idx.sort(key=lambda i: len(data[i][0]) + len(data[i][1]))
        size = -(-len(idx) // LENGTH_PARTS)
        sel, targets, weights, soft = [], [], [], []
        for part in (idx[k : k + size] for k in range(0, len(idx), size)):
            ids, weight, keep, part_soft = _rows(data, part, pad_id, recipe["focus_weight"])
            row = torch.cumsum(keep.flatten(), 0).view_as(keep) - 1 + sum(len(t) for t in targets)
            soft += [(int(row[j, pos]), alts) for j, pos, alts in part_soft]
            sel.append(model.model(input_ids=ids).last_hidden_state[:, :-1][keep])
            targets.append(ids[:, 1:][keep])
            weights.append(weight[:, :-1][keep])
        # the output layer only where a loss is taken (response tokens and the uniform targets' positions): over a
        # few hundred words the head and its log-softmax on every position were most of a step
        logits = model.lm_head(torch.cat(sel)).float()
        ce = torch.nn.functional.cross_entropy(logits, torch.cat(targets), reduction="none")
        w = torch.cat(weights)
        total, norm = (ce * w).sum(), w.sum()
        for k, alts in soft:
            total = total - recipe["focus_weight"] * torch.log_softmax(logits[k], -1)[alts].mean()
            norm = norm + recipe["focus_weight"]
        loss = total / norm
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    return losses


def build_reader(out: Path, recipe: dict[str, Any]) -> None:
    """Write the reader (weights, tokenizer, recipe with its training log) into the empty folder ``out``."""
    import torch
    from alignopsd.engine.checkpoint.manifest import write_manifest
    from alignopsd.engine.checkpoint.weights import save_model_files
    from alignopsd.engine.models.loading import tiny_config
    from transformers import LlamaForCausalLM

    t0 = time.perf_counter()
    tok = build_tokenizer(recipe)
    cfg = tiny_config(len(tok))
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    cfg.initializer_range = recipe["init_range"]
    cfg.num_hidden_layers = recipe["layers"]
    cfg.num_attention_heads = cfg.num_key_value_heads = recipe["heads"]
    cfg.head_dim = cfg.hidden_size // recipe["heads"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe["seed"])
        model = LlamaForCausalLM(cfg)
        data = examples(tok, recipe)
        losses = train(model, data, recipe, tok.pad_token_id)
    model.generation_config.pad_token_id = tok.pad_token_id
    save_model_files(out, model)
    tok.save_pretrained(str(out))
    log = {"examples": len(data), "loss_first": losses[:5], "loss_last": losses[-5:], "seconds": 0.0}
    log["seconds"] = time.perf_counter() - t0
    (out / RECIPE_FILE).write_text(json.dumps({"key": recipe_key(recipe), "recipe": recipe, "log": log}) + "\n")
    write_manifest(out)


def cached_reader_problem(folder: Path, recipe: dict[str, Any]) -> str | None:
    """Why the cached ``folder`` cannot be trusted as the reader of ``recipe`` (None: it can)."""
    from alignopsd.engine.checkpoint.manifest import verify_manifest

    try:
        verify_manifest(folder, require=(RECIPE_FILE, "config.json", "tokenizer.json"))
        stored = json.loads((folder / RECIPE_FILE).read_text())
    except (OSError, ValueError) as exc:  # ManifestError is a ValueError; so is malformed JSON
        return f"{type(exc).__name__}: {exc}"
    if not isinstance(stored, dict) or stored.get("key") != recipe_key(recipe) or stored.get("recipe") != recipe:
        return "its stored recipe is not this reader's"
    return None


def ensure_reader(root: str | Path | None = None, recipe: dict[str, Any] | None = None) -> Path:
    """The reader's folder under ``root`` (default: the engine's cache folder, ``bench/``), built when absent and
    rebuilt when the cached one fails its check (:func:`cached_reader_problem`)."""
    from alignopsd.engine.infra.cache import atomic_cached_dir, cache_root

    recipe = dict(recipe or RECIPE)
    base = Path(root) if root is not None else cache_root() / "bench"
    target = base / f"credit-reader-{recipe_key(recipe)}"
    if target.exists():
        why = cached_reader_problem(target, recipe)
        if why is None:
            return target
        print(f"bench.credit: the cached reader {target.name} is not trusted ({why}); rebuilding it", flush=True)
        aside = target.with_name(f"{target.name}.bad-{time.time_ns()}")
        target.rename(aside)
        shutil.rmtree(aside, ignore_errors=True)
    atomic_cached_dir(target, lambda tmp: build_reader(tmp, recipe))
    why = cached_reader_problem(target, recipe)
    if why is not None:
        raise RuntimeError(f"the reader just built at {target} fails its own check: {why}")
    return target


def choice_probs(model, tok, prompts: list[str], users: list[str]) -> list[dict[str, float]]:
    """Per prompt, the candidate-choice backend's probability of each admissible action (its two candidate texts
    summed; temperature 1), scored with the engine's shared-prefix scorer as the backend samples."""
    import torch
    from alignopsd.engine.generation.choice import candidate_texts
    from alignopsd.engine.policy.row_scoring import score_shared_prefix
    from alignopsd.engine.step.rollout import left_pad, right_pad

    eos = tok.eos_token_id
    cands = [candidate_texts(u) for u in users]
    p_ids = tok(prompts, add_special_tokens=False)["input_ids"]
    rows = [r + [eos] for cs in cands for r in tok(cs, add_special_tokens=False)["input_ids"]]
    row_prompt = torch.tensor([i for i, cs in enumerate(cands) for _ in cs], dtype=torch.long)
    pi, pm = left_pad(p_ids, max(len(p) for p in p_ids), eos)
    ci, cm = right_pad(rows, max(len(r) for r in rows), 0)
    with torch.no_grad():
        lp = score_shared_prefix(model.eval(), pi, pm, row_prompt, ci, cm)[0]
    seq = (lp * cm).sum(1)
    out, start = [], 0
    for cs in cands:
        probs = torch.softmax(seq[start : start + len(cs)].double(), 0).tolist()
        acts: dict[str, float] = {}
        for c, p in zip(cs, probs):
            a = c.split("<action>", 1)[1].split("</action>", 1)[0]
            acts[a] = acts.get(a, 0.0) + p
        out.append(acts)
        start += len(cs)
    return out


def decisive_choice(
    model_dir: str | Path, rule: dict[str, Any], seeds: list[int], episodes: int = 4, fam: ModuleType = rules
) -> dict:
    """The premise on the benchmark's tasks (the tasks of each seed's run, under ``rule``): on decisive turns whose
    action the rule fixes, reached by random play, the probability that the policy picks the winning action
    with the skill in its prompt (teacher) and without (student), per kind and pooled, with chance beside it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    rng = random.Random(12345)
    states: list[tuple[str, str, str, str, str, int]] = []  # kind, student, teacher, user, win, options
    for s in seeds:
        for task in fam.load_tasks("train", len(fam.KINDS), s, rule):
            for _ in range(episodes):
                for t in episode_turns(task, rng, fam):
                    if t["win"] is not None:
                        st, te = prompt_texts(tok, task, t, rule[task.category], fam)
                        states.append((task.category, st, te, t["user"], t["win"], len(t["actions"])))
    out: dict[str, Any] = {"states": len(states)}
    for view, col in (("student", 1), ("teacher", 2)):
        probs = choice_probs(model, tok, [x[col] for x in states], [x[3] for x in states])
        wins = [p.get(x[4], 0.0) for p, x in zip(probs, states)]
        for kind in (*fam.KINDS, "all"):
            sel = [w for w, x in zip(wins, states) if kind in ("all", x[0])]
            chance = [1 / x[5] for x in states if kind in ("all", x[0])]
            out.setdefault(kind, {"n": len(sel), "chance": sum(chance) / max(1, len(chance))})
            out[kind][view] = sum(sel) / max(1, len(sel))
            out[kind][f"{view}_argmax"] = sum(
                max(p, key=p.get) == x[4] for p, x in zip(probs, states) if kind in ("all", x[0])
            ) / max(1, len(sel))
    return out


PREMISE_MIN = 0.8  # the winning action's probability with the skill, on decisive turns, at least
PREMISE_TOL = 0.1  # without the skill: chance within this


def premise_failures(choice: dict, fam: ModuleType = rules) -> list[str]:
    """Where the premise fails (empty: it holds), per task kind and pooled over them."""
    out = []
    for kind in (*fam.KINDS, "all"):
        c = choice.get(kind)
        if not c or not c.get("n"):
            out.append(f"{kind}: no decisive turn whose action the rule fixes was reached")
            continue
        if c["teacher"] < PREMISE_MIN:
            out.append(f"{kind}: with the skill the winning action has p = {c['teacher']:.3f} < {PREMISE_MIN}")
        if abs(c["student"] - c["chance"]) > PREMISE_TOL:
            out.append(
                f"{kind}: without the skill the winning action has p = {c['student']:.3f}, not chance "
                f"{c['chance']:.3f} ± {PREMISE_TOL}"
            )
    return out
