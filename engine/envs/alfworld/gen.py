"""ALFWorld game generator: procedurally generated household rooms in the official game format.

Each game is written exactly like a game of the ALFWorld download::

    <out>/json_2.1.1/<split>/<task_type>-<Object>-None-<Parent>-<room_id>/trial_<id>/
        traj_data.json   # task_type, pddl_params, scene, turk_annotations (read by alfworld's expert)
        game.tw-pddl     # JSON: pddl_domain, grammar (task text filled in), pddl_problem, solvable, walkthrough

and is played by alfworld/TextWorld's PDDL engine (fast-downward state, alfred.twl2 grammar). The
domain (``alfred.pddl``) and grammar (``alfred.twl2``) are the files shipped inside the alfworld wheel;
the goal formulas and task phrasings are alfworld's own (``alfworld.gen.goal_library``), and which
object fits which receptacle is alfworld's ``VAL_RECEPTACLE_OBJECTS`` table.

Rooms (kitchen, bedroom, bathroom, living room) get a random set of receptacles of the kinds found in
such rooms in ALFRED, objects scattered over receptacles that can hold them (some inside closed
cabinets, drawers, fridges...), and one of the six task types valid for that room (alfworld's
``GOALS_VALID``). A game is kept only when alfworld's hand-coded TextWorld expert
(``HandCodedTWAgent``, through alfworld's ``AlfredExpert`` wrapper) wins it within ``max_steps``; the
expert's winning action sequence is stored as the walkthrough.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alignopsd.engine.envs.alfworld.textworld import make_textworld_env

TASK_TYPES: tuple[str, ...] = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
# Short category names (TaskSpec.category) and the paper's Table 1 column labels.
CATEGORY: dict[str, str] = {
    "pick_and_place_simple": "pick",
    "look_at_obj_in_light": "look",
    "pick_clean_then_place_in_recep": "clean",
    "pick_heat_then_place_in_recep": "heat",
    "pick_cool_then_place_in_recep": "cool",
    "pick_two_obj_and_place": "pick2",
}
_VALID_ROOMS: dict[str, tuple[str, ...]] = {  # alfworld.gen.constants.GOALS_VALID
    "pick_and_place_simple": ("kitchen", "livingroom", "bathroom", "bedroom"),
    "pick_two_obj_and_place": ("kitchen", "livingroom", "bathroom", "bedroom"),
    "look_at_obj_in_light": ("livingroom", "bedroom"),
    "pick_clean_then_place_in_recep": ("kitchen", "bathroom"),
    "pick_heat_then_place_in_recep": ("kitchen",),
    "pick_cool_then_place_in_recep": ("kitchen",),
}

# Receptacle kinds per room: (class, min count, max count).
_ROOM_RECEPTACLES: dict[str, list[tuple[str, int, int]]] = {
    "kitchen": [
        ("CounterTop", 1, 3), ("Cabinet", 2, 6), ("Drawer", 1, 4), ("Fridge", 1, 1), ("Microwave", 1, 1),
        ("SinkBasin", 1, 1), ("StoveBurner", 2, 4), ("DiningTable", 0, 1), ("CoffeeMachine", 1, 1),
        ("GarbageCan", 1, 1), ("Toaster", 0, 1), ("Shelf", 0, 2),
    ],
    "bedroom": [
        ("Bed", 1, 1), ("Desk", 0, 1), ("Drawer", 2, 5), ("Dresser", 0, 1), ("Shelf", 0, 3),
        ("SideTable", 1, 2), ("GarbageCan", 1, 1), ("Safe", 0, 1), ("LaundryHamper", 0, 1),
    ],
    "bathroom": [
        ("Toilet", 1, 1), ("SinkBasin", 1, 2), ("BathtubBasin", 0, 1), ("CounterTop", 1, 1), ("Cabinet", 1, 4),
        ("Drawer", 0, 3), ("TowelHolder", 1, 1), ("HandTowelHolder", 0, 1), ("ToiletPaperHanger", 1, 1),
        ("GarbageCan", 1, 1),
    ],
    "livingroom": [
        ("Sofa", 1, 1), ("ArmChair", 0, 2), ("CoffeeTable", 1, 1), ("SideTable", 1, 2), ("TVStand", 0, 1),
        ("Shelf", 0, 3), ("Drawer", 0, 3), ("Dresser", 0, 1), ("GarbageCan", 1, 1), ("Ottoman", 0, 1),
        ("Cabinet", 0, 2),
    ],
}  # fmt: skip
_ROOM_OBJECTS: dict[str, tuple[str, ...]] = {
    "kitchen": (
        "Apple", "Bread", "ButterKnife", "Cup", "DishSponge", "Egg", "Fork", "Kettle", "Knife", "Ladle",
        "Lettuce", "Mug", "Pan", "Plate", "Pot", "Potato", "PepperShaker", "SaltShaker", "SoapBottle",
        "Spatula", "Spoon", "Tomato", "Bowl", "WineBottle",
    ),
    "bedroom": (
        "AlarmClock", "BasketBall", "BaseballBat", "Book", "CD", "CellPhone", "CreditCard", "KeyChain",
        "Laptop", "Pen", "Pencil", "Pillow", "TennisRacket", "Watch", "Mug", "Cloth", "Vase", "Statue",
        "TissueBox", "Bowl",
    ),
    "bathroom": (
        "Cloth", "HandTowel", "SoapBar", "SoapBottle", "SprayBottle", "ToiletPaper", "Candle", "TissueBox",
        "DishSponge",
    ),
    "livingroom": (
        "Book", "Box", "CellPhone", "CreditCard", "KeyChain", "Laptop", "Newspaper", "Pillow", "RemoteControl",
        "Statue", "Vase", "Watch", "Candle", "TissueBox", "Plate", "Bowl", "WateringCan",
    ),
}  # fmt: skip
_LAMP_HOLDERS = ("Desk", "SideTable", "Dresser")
_EXTRA_CONTAIN = {"TowelHolder": {"Towel", "HandTowel"}, "ToiletPaperHanger": {"ToiletPaper"}}
_NOT_TARGET_PARENTS = {"Microwave", "CoffeeMachine", "Toaster", "StoveBurner", "ToiletPaperHanger", "HandTowelHolder"}


def _constants():
    import alfworld.gen.constants as c  # noqa: PLC0415 - heavy import, only when generating

    return c


def _can_contain(recep: str, obj: str) -> bool:
    c = _constants()
    return obj in c.VAL_RECEPTACLE_OBJECTS.get(recep, set()) or obj in _EXTRA_CONTAIN.get(recep, set())


def alfworld_logic_files() -> tuple[str, str]:
    """Paths of the domain and grammar shipped inside the alfworld wheel."""
    from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH  # noqa: PLC0415

    for p in (ALFRED_PDDL_PATH, ALFRED_TWL2_PATH):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"alfworld package file missing: {p}")
    return ALFRED_PDDL_PATH, ALFRED_TWL2_PATH


def _mangle(name: str, r: random.Random) -> str:
    """An ALFRED-style object id, ``Name|-01.75|+00.60|+00.47`` mangled the way alfworld's files are."""

    def coord() -> str:
        v = r.uniform(-3.0, 3.0)
        s = f"{v:+06.2f}".replace("+", "_plus_").replace("-", "_minus_").replace(".", "_dot_")
        return s

    return f"{name}_bar_{coord()}_bar_{coord()}_bar_{coord()}"


@dataclass
class _Obj:
    pid: str  # PDDL id
    cls: str
    recep: str  # PDDL id of the receptacle holding it


@dataclass
class _Rec:
    pid: str
    cls: str
    loc: str


def _sample_room(room: str, r: random.Random, small: bool = False) -> list[_Rec]:
    c = _constants()
    recs: list[_Rec] = []
    used_locs: set[str] = set()

    def new_loc() -> str:
        while True:
            x, z = r.randint(-9, 9), r.randint(-9, 9)
            loc = f"loc_bar_{x}_bar_{z}_bar_{r.choice((0, 1, 2, 3))}_bar_{r.choice((0, 30, 45, 60))}"
            loc = loc.replace("-", "_minus_")
            if loc not in used_locs:
                used_locs.add(loc)
                return loc

    for cls, lo, hi in _ROOM_RECEPTACLES[room]:
        if small:  # at most one of each kind (two for the kinds a room needs two of): short observations
            hi = max(lo, min(hi, 1))
        for _ in range(r.randint(lo, hi)):
            if cls == "SinkBasin":
                pid = f"Sink_bar_{_mangle('x', r).split('_bar_', 1)[1]}_bar_SinkBasin"
            elif cls == "BathtubBasin":
                pid = f"Bathtub_bar_{_mangle('x', r).split('_bar_', 1)[1]}_bar_BathtubBasin"
            else:
                pid = _mangle(cls, r)
            recs.append(_Rec(pid, cls, new_loc()))
    assert all(rc.cls in c.RECEPTACLES for rc in recs)
    return recs


def _task_choices(task_type: str, room: str, recs: list[_Rec]) -> list[tuple[str, str, str]]:
    """All (object class, parent class, toggle class) triples valid for this task in this room."""
    c = _constants()
    classes = {rc.cls for rc in recs}
    objs = [o for o in _ROOM_OBJECTS[room] if any(_can_contain(rc, o) for rc in classes)]
    out = []
    if task_type == "look_at_obj_in_light":
        if not classes & set(_LAMP_HOLDERS):
            return []
        return [(o, "", "DeskLamp") for o in objs]
    needs = {
        "pick_clean_then_place_in_recep": ("SinkBasin", c.VAL_RECEPTACLE_OBJECTS["SinkBasin"]),
        "pick_heat_then_place_in_recep": ("Microwave", c.VAL_RECEPTACLE_OBJECTS["Microwave"]),
        "pick_cool_then_place_in_recep": ("Fridge", c.VAL_RECEPTACLE_OBJECTS["Fridge"]),
    }
    for o in objs:
        if task_type in needs:
            appliance, allowed = needs[task_type]
            if appliance not in classes or o not in allowed:
                continue
        for p in sorted(classes):
            if p in _NOT_TARGET_PARENTS or not _can_contain(p, o):
                continue
            if task_type in needs and p == needs[task_type][0]:
                continue
            out.append((o, p, ""))
    return out


def _place(r: random.Random, obj_cls: str, recs: list[_Rec], avoid: set[str]) -> _Rec | None:
    options = [rc for rc in recs if rc.cls not in avoid and _can_contain(rc.cls, obj_cls)]
    return r.choice(options) if options else None


def _build_problem(
    name: str, recs: list[_Rec], objs: list[_Obj], agent_loc: str, goal: str, lamp_ids: Sequence[str]
) -> str:
    c = _constants()
    otypes = sorted({o.cls for o in objs} | {"Knife", "ButterKnife"})
    rtypes = sorted({rc.cls for rc in recs} | {"SinkBasin", "Microwave", "Fridge"})
    sink_list = c.VAL_RECEPTACLE_OBJECTS["SinkBasin"]
    heat_list = c.VAL_RECEPTACLE_OBJECTS["Microwave"]
    cool_list = c.VAL_RECEPTACLE_OBJECTS["Fridge"]
    lines = [f"(define (problem {name})", "(:domain alfred)", "(:objects", "agent1 - agent"]
    lines += [f"{t}Type - otype" for t in otypes]
    lines += [f"{t}Type - rtype" for t in rtypes]
    lines += [f"{o.pid} - object" for o in objs]
    lines += [f"{rc.pid} - receptacle" for rc in recs]
    lines += [f"{loc} - location" for loc in sorted({rc.loc for rc in recs} | {agent_loc})]
    lines += [")", "(:init", f"(atLocation agent1 {agent_loc})"]
    for rc in recs:
        lines.append(f"(receptacleType {rc.pid} {rc.cls}Type)")
        lines.append(f"(receptacleAtLocation {rc.pid} {rc.loc})")
        if rc.cls in c.OPENABLE_CLASS_LIST:
            lines.append(f"(openable {rc.pid})")
    loc_of = {rc.pid: rc.loc for rc in recs}
    for o in objs:
        lines.append(f"(objectType {o.pid} {o.cls}Type)")
        lines.append(f"(inReceptacle {o.pid} {o.recep})")
        lines.append(f"(objectAtLocation {o.pid} {loc_of[o.recep]})")
        if o.pid in lamp_ids:
            lines.append(f"(toggleable {o.pid})")
            continue
        lines.append(f"(pickupable {o.pid})")
        lines.append(f"(moveable {o.pid})")
        if o.cls in sink_list:
            lines.append(f"(cleanable {o.pid})")
        if o.cls in heat_list:
            lines.append(f"(heatable {o.pid})")
        if o.cls in cool_list:
            lines.append(f"(coolable {o.pid})")
    for rt in rtypes:
        for ot in otypes:
            if _can_contain(rt, ot):
                lines.append(f"(canContain {rt}Type {ot}Type)")
    lines.append(")")
    lines.append(goal.strip())
    return "\n".join(lines) + "\n"


def _goal_pddl(task_type: str, obj: str, parent: str, toggle: str) -> str:
    from alfworld.gen import goal_library as glib  # noqa: PLC0415

    return glib.gdict[task_type]["pddl"].format(obj=obj, recep=parent, toggle=toggle, mrecep="").replace("#", "-")


def _task_text(task_type: str, obj: str, parent: str, toggle: str, r: random.Random) -> str:
    from alfworld.gen import goal_library as glib  # noqa: PLC0415

    template = r.choice(glib.gdict[task_type]["templates"])
    return template.format(obj=obj.lower(), recep=parent.lower(), toggle=toggle.lower(), mrecep="")


def sample_game(task_type: str, seed: int, room: str | None = None, small: bool = False) -> dict[str, Any] | None:
    """Sample one game description (no I/O); None when the room cannot host the task type.

    ``small`` samples smaller rooms (at most one receptacle of most kinds, 3-6 distractor objects), whose
    observations and admissible-action lists, hence prompts, are about half as long.
    """
    if task_type not in TASK_TYPES:
        raise ValueError(f"task_type: expected one of {TASK_TYPES}, got {task_type!r}")
    r = random.Random(seed)
    room = room or r.choice(_VALID_ROOMS[task_type])
    if room not in _VALID_ROOMS[task_type]:
        raise ValueError(f"room: {room!r} cannot host {task_type}")
    recs = _sample_room(room, r, small)
    choices = _task_choices(task_type, room, recs)
    if not choices:
        return None
    obj_cls, parent_cls, toggle_cls = r.choice(choices)
    objs: list[_Obj] = []
    lamp_ids: list[str] = []
    avoid = {parent_cls} if parent_cls else set()
    n_target = r.randint(2, 3) if task_type == "pick_two_obj_and_place" else r.randint(1, 3)
    for _ in range(n_target):
        # Targets start away from the goal receptacle (and, for the transform tasks, the appliances).
        extra = {"Microwave", "Fridge", "SinkBasin"} if task_type != "pick_and_place_simple" else set()
        rc = _place(r, obj_cls, recs, avoid | extra)
        if rc is None:
            rc = _place(r, obj_cls, recs, avoid)
        if rc is None:
            return None
        objs.append(_Obj(_mangle(obj_cls, r), obj_cls, rc.pid))
    if toggle_cls:
        holders = [rc for rc in recs if rc.cls in _LAMP_HOLDERS]
        rc = r.choice(holders)
        lamp = _Obj(_mangle(toggle_cls, r), toggle_cls, rc.pid)
        objs.append(lamp)
        lamp_ids.append(lamp.pid)
    others = [o for o in _ROOM_OBJECTS[room] if o != obj_cls]
    for _ in range(r.randint(3, 6) if small else r.randint(8, 16)):
        cls = r.choice(others)
        rc = _place(r, cls, recs, set())
        if rc is not None:
            objs.append(_Obj(_mangle(cls, r), cls, rc.pid))
    agent_loc = f"loc_bar_{r.randint(-9, 9)}_bar_{r.randint(-9, 9)}_bar_{r.choice((0, 1, 2, 3))}_bar_30".replace(
        "-", "_minus_"
    )
    if agent_loc in {rc.loc for rc in recs}:
        agent_loc = agent_loc.replace("_bar_30", "_bar_15")
    trial = f"trial_T{seed & 0xFFFFFFFF:010d}"
    dirname = f"{task_type}-{obj_cls}-None-{parent_cls or 'None'}-{room}"
    goal = _goal_pddl(task_type, obj_cls, parent_cls, toggle_cls)
    problem = _build_problem(f"plan_{trial}", recs, objs, agent_loc, goal, lamp_ids)
    task_text = _task_text(task_type, obj_cls, parent_cls, toggle_cls, r)
    traj_data = {
        "task_type": task_type,
        "task_id": trial,
        "pddl_params": {
            "object_target": obj_cls,
            "parent_target": parent_cls,
            "toggle_target": toggle_cls,
            "mrecep_target": "",
            "object_sliced": False,
        },
        "scene": {"room_type": room, "floor_plan": f"generated_{room}", "scene_num": seed, "random_seed": seed},
        "turk_annotations": {"anns": [{"task_desc": task_text[0].upper() + task_text[1:] + ".", "high_descs": []}]},
        "generator": "alignopsd.alfworld_gen",
    }
    return {"dirname": dirname, "trial": trial, "problem": problem, "traj_data": traj_data, "task_text": task_text}


def _write_game(game: dict[str, Any], split_dir: Path, domain: str, grammar: str) -> Path:
    d = split_dir / game["dirname"] / game["trial"]
    d.mkdir(parents=True, exist_ok=True)
    (d / "traj_data.json").write_text(json.dumps(game["traj_data"], indent=1))
    gamefile = d / "game.tw-pddl"
    data = {
        "pddl_domain": domain,
        "grammar": grammar.replace("UNKNOWN GOAL", game["task_text"]),
        "pddl_problem": game["problem"],
        "solvable": False,
        "walkthrough": [],
    }
    gamefile.write_text(json.dumps(data))
    return gamefile


_EXPERT_ENV: list[Any] = []


def expert_walkthrough(gamefile: str | os.PathLike, max_steps: int = 50, seed: int = 0) -> list[str] | None:
    """Play ``gamefile`` with alfworld's hand-coded TextWorld expert; the winning actions, or None."""

    state_rng = random.getstate()
    random.seed(seed)  # the expert breaks ties with the global RNG
    try:
        if not _EXPERT_ENV:
            _EXPERT_ENV.append(make_textworld_env(expert=True))
        env = _EXPERT_ENV[0]
        env.load(str(gamefile))
        state = env.reset()
        actions: list[str] = []
        for _ in range(max_steps):
            action = state["extra.expert_plan"][0]
            state, _, done = env.step(action)
            actions.append(action)
            if state["won"]:
                return actions
            if done:
                return None
        return None
    except Exception:  # noqa: BLE001 - the expert gives up by raising (timeout / failed)
        return None
    finally:
        random.setstate(state_rng)


def _generate_one(
    i: int, seed: int, split: str, task_type: str, split_dir: str, max_steps: int, max_tries: int, small: bool = False
) -> str:
    """Game ``i`` of a split: the first of its seeded candidates that alfworld's expert wins."""
    domain_path, grammar_path = alfworld_logic_files()
    domain = Path(domain_path).read_text()
    grammar = Path(grammar_path).read_text()
    for attempt in range(max_tries):
        game_seed = int.from_bytes(hashlib.sha256(f"{seed}:{split}:{i}:{attempt}".encode()).digest()[:4], "little")
        game = sample_game(task_type, game_seed, small=small)
        if game is None:
            continue
        gamefile = _write_game(game, Path(split_dir), domain, grammar)
        walk = expert_walkthrough(gamefile, max_steps=max_steps, seed=game_seed)
        if walk is None:
            shutil.rmtree(gamefile.parent)
            continue
        data = json.loads(gamefile.read_text())
        data["solvable"] = True
        data["walkthrough"] = walk
        gamefile.write_text(json.dumps(data))
        return str(gamefile)
    raise RuntimeError(f"could not generate a solvable {task_type} game in {max_tries} tries")


def generate_games(
    n: int,
    out_dir: str | os.PathLike,
    seed: int = 0,
    split: str = "train",
    task_types: Sequence[str] = TASK_TYPES,
    max_steps: int = 50,
    max_tries_per_game: int = 20,
    workers: int = 1,
    small: bool = False,
) -> list[Path]:
    """Write ``n`` expert-verified games of ``split`` under ``out_dir/json_2.1.1/<split>/``.

    Task types cycle through ``task_types`` (so every type is present when ``n >= 6``). The same
    (n, seed, split, task_types) always writes the same games, whatever ``workers`` (processes used
    to generate and verify games in parallel). Returns the game file paths in index order. ``max_steps`` also
    bounds the walkthroughs kept (a game whose expert needs more steps is replaced by the next candidate);
    ``small``: smaller rooms (see :func:`sample_game`).
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n: expected an int >= 1, got {n!r}")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers: expected an int >= 1, got {workers!r}")
    if not task_types:
        raise ValueError("task_types: expected at least one task type")
    for t in task_types:
        if t not in TASK_TYPES:
            raise ValueError(f"task_types: unknown task type {t!r}")
    alfworld_logic_files()
    split_dir = Path(out_dir) / "json_2.1.1" / split
    split_dir.mkdir(parents=True, exist_ok=True)
    jobs = [
        (i, seed, split, task_types[i % len(task_types)], str(split_dir), max_steps, max_tries_per_game, small)
        for i in range(n)
    ]
    if workers == 1 or n == 1:
        return [Path(_generate_one(*job)) for job in jobs]
    import multiprocessing as mp  # noqa: PLC0415
    from concurrent.futures import ProcessPoolExecutor  # noqa: PLC0415

    with ProcessPoolExecutor(max_workers=min(workers, n), mp_context=mp.get_context("spawn")) as pool:
        return [Path(p) for p in pool.map(_generate_one, *zip(*jobs))]


def game_facts(gamefile: str | os.PathLike) -> dict[str, Any]:
    """The facts a generated (or official) game states about itself: ``walkthrough`` (the expert's winning
    actions), ``task_type``, ``object`` / ``parent`` / ``toggle`` (lower-case target classes) and ``task``
    (the task sentence). Raises ValueError when the game has no walkthrough."""
    path = Path(gamefile)
    data = json.loads(path.read_text())
    walk = list(data.get("walkthrough") or [])
    if not walk:
        raise ValueError(f"gamefile: {path} has no expert walkthrough")
    traj_path = path.parent / "traj_data.json"
    traj = json.loads(traj_path.read_text()) if traj_path.is_file() else {}
    params = traj.get("pddl_params", {})
    anns = traj.get("turk_annotations", {}).get("anns", [{}])
    return {
        "walkthrough": walk,
        "task_type": traj.get("task_type", ""),
        "object": str(params.get("object_target", "")).lower(),
        "parent": str(params.get("parent_target", "")).lower(),
        "toggle": str(params.get("toggle_target", "")).lower(),
        "task": str(anns[0].get("task_desc", "")) if anns else "",
    }
