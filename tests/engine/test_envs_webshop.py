"""WebShop: the original reward on hand-built goals, navigation, bad actions, the original-data adapter, prompts."""

from __future__ import annotations

from pathlib import Path

import pytest
from alignopsd.engine.envs.base import TaskSpec
from alignopsd.engine.envs.prompts import PromptContext
from alignopsd.engine.envs.webshop.data import get_catalogue
from alignopsd.engine.envs.webshop.env import WebShopEnv, find_original_files, load_tasks, read_action, webshop_prompt
from alignopsd.engine.envs.webshop.generate import generate_catalogue
from alignopsd.engine.envs.webshop.reward import get_reward, normalize_color, token_set_ratio, webshop_metrics

FIXTURE = Path(__file__).resolve().parents[1] / "assets" / "webshop_fixture"
SMALL = {"kind": "generated", "seed": 3, "n_products": 200, "n_goals": 40}


@pytest.fixture(autouse=True, scope="module")
def _cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("ALIGNOPSD_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


# ---------------------------------------------------------------------------------------------- reward

SHIRT = {
    "asin": "B0SHIRT001",
    "name": "Acme Slim Fit Cotton T-Shirt",
    "Title": "Acme Slim Fit Cotton T-Shirt",
    "query": "men's t-shirts",
    "product_category": "Clothing, Shoes & Jewelry › Men › Clothing › Shirts › T-Shirts",
    "Description": "A soft tee that is machine washable.",
    "BulletPoints": ["Crew neck"],
    "Attributes": ["slim fit", "cotton"],
    "options": {"color": ["navy", "black"], "size": ["small", "large"]},
}
GOAL = {
    "asin": "B0SHIRT001",
    "name": "Acme Slim Fit Cotton T-Shirt",
    "query": "men's t-shirts",
    "product_category": SHIRT["product_category"],
    "instruction_text": "i need a slim fit machine washable t-shirt in navy color and size large, "
    "and price lower than 30.00 dollars",
    "attributes": ["slim fit", "machine washable"],  # the second only in the description
    "goal_options": ["navy", "large"],
    "price_upper": 30.0,
}
TEA = {
    "asin": "B0TEA00001",
    "name": "Leafwell Organic Green Tea Bags",
    "Title": "Leafwell Organic Green Tea Bags",
    "query": "green tea bags",
    "product_category": "Grocery & Gourmet Food › Beverages › Tea › Green",
    "Description": "slim fit machine washable",  # attributes text alone must not rescue a wrong type
    "BulletPoints": [],
    "Attributes": ["slim fit"],
    "options": {"color": ["navy"], "size": ["large"]},
}


def test_reward_full_purchase_is_one():
    r, d = get_reward(SHIRT, GOAL, 20.0, {"color": "navy", "size": "large"})
    assert r == pytest.approx(1.0)
    assert d["n_attr_matched"] == 2 and d["n_option_matched"] == 2 and d["r_price"] and d["r_type"] == 1.0


@pytest.mark.parametrize(
    ("price", "options", "goal_update", "expected"),
    [
        (20.0, {"color": "black", "size": "large"}, {}, 4 / 5),  # one option wrong
        (20.0, {}, {}, 3 / 5),  # no option selected
        (35.0, {"color": "navy", "size": "large"}, {}, 4 / 5),  # over the price bound
        (20.0, {"color": "navy", "size": "large"}, {"attributes": ["slim fit", "waterproof"]}, 4 / 5),
        (20.0, {"color": "navy", "size": "small"}, {"attributes": ["cotton"]}, 3 / 4),
    ],
)
def test_reward_partial_purchases(price, options, goal_update, expected):
    r, _ = get_reward(SHIRT, {**GOAL, **goal_update}, price, options)
    assert r == pytest.approx(expected)


def test_reward_wrong_type_is_zero():
    r, d = get_reward(TEA, GOAL, 5.0, {"color": "navy", "size": "large"})
    assert d["r_type"] == 0.0 and not d["query_match"] and not d["category_match"]
    assert r == 0.0


def test_reward_weak_type_match_halves():
    # no query/category match; goal nouns {acme, fit, cotton, crew, tee, shirt}, overlap {cotton}: 1/6 -> 0.5
    goal = {**GOAL, "name": "Acme Fit Cotton Crew Tee Shirt"}
    towel = {**TEA, "name": "Zeta Cotton Towel", "Title": "Zeta Cotton Towel", "query": "towels",
             "product_category": "Home › Bath", "Attributes": ["slim fit", "machine washable"]}  # fmt: skip
    r, d = get_reward(towel, goal, 5.0, {"color": "navy", "size": "large"})
    assert d["title_score"] == pytest.approx(1 / 6) and d["r_type"] == 0.5
    assert r == pytest.approx(0.5)


def test_fuzzy_and_colour_rules():
    assert token_set_ratio("machine washable", "Washable, machine!") == 100
    assert token_set_ratio("small", "large") <= 85
    assert token_set_ratio("", "x") == 0
    assert normalize_color("dark navy") == "dark" and normalize_color("jasmine") == "jasmine"


def test_metrics_score_and_acc():
    m = webshop_metrics([1.0, 0.5, 0.0, 1.0])
    assert m["score"] == pytest.approx(62.5) and m["acc"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="task_scores"):
        webshop_metrics([])


# ------------------------------------------------------------------------------------------ navigation


def _expert(env: WebShopEnv, task: TaskSpec, query: str | None = None, select: bool = True):
    """Search the target's title, page to it, select the goal options, buy. Returns the last StepResult."""
    g = task.payload["goal"]
    env.reset(task, 0)
    r = env.step(f"search[{query or g['name']}]")
    assert r.info["action_admissible"]
    while g["asin"].lower() not in r.info["available_actions"]["clickables"]:
        assert "click[next >]" in r.info["admissible_actions"], "target not in the search results"
        r = env.step("click[next >]")
    r = env.step(f"click[{g['asin']}]")
    assert r.info["page"] == "item"
    if select:
        for o in g["goal_options"]:
            r = env.step(f"click[{o}]")
            assert r.info["action_admissible"], o
    return env.step("click[Buy Now]")


def test_catalogue_is_large_seeded_and_varied():
    products, goals, prices = generate_catalogue(0)
    assert len(products) >= 2000 and len({p["asin"] for p in products}) == len(products)
    assert {p["category"] for p in products} == {"beauty", "electronics", "fashion", "food", "furniture"}
    assert all(p["Attributes"] and p["pricing"] for p in products)
    assert len(goals) >= 1000 and all("price lower than" in g["instruction_text"] for g in goals[:50])
    again = generate_catalogue(0, n_products=200, n_goals=10)
    assert again == generate_catalogue(0, n_products=200, n_goals=10)
    assert again[0] != generate_catalogue(1, n_products=200, n_goals=10)[0]


def test_navigation_pages_and_options():
    task = load_tasks("test", 1, source=SMALL)[0]
    env = WebShopEnv()
    obs, info = env.reset(task, 0)
    assert obs == "'Search'" and info["admissible_actions"] == ["search[<your query>]"]
    assert info["task"].startswith(task.payload["goal"]["instruction_text"][:20])
    assert "Instruction:" in info["raw_observation"]
    r = env.step("search[black navy red]")  # colours many products offer: more than one page of results
    assert r.info["page"] == "results" and "Page 1 (Total results: 50)" in r.observation
    clicks = r.info["available_actions"]["clickables"]
    asins = [c for c in clicks if c.startswith("b0")]
    assert len(asins) == 10 and "next >" in clicks and "< prev" not in clicks
    r = env.step("click[Next >]")  # clicks match case-insensitively
    assert "Page 2" in r.observation and "click[< prev]" in r.info["admissible_actions"]
    r = env.step("click[< prev]")
    assert "Page 1" in r.observation
    r = env.step(f"click[{asins[0]}]")
    assert r.info["page"] == "item"
    for label in ("'Description'", "'Features'", "'Reviews'", "'Buy Now'", "'< Prev'", "'Back to Search'"):
        assert label in r.observation
    product = env.cat.by_asin[asins[0].upper()]
    oname, values = next(iter(product["options"].items()))
    r = env.step(f"click[{values[-1]}]")
    assert f"You have clicked {values[-1]}." in r.observation and env.selected == {oname: values[-1]}
    r = env.step("click[features]")
    assert r.info["page"] == "sub" and product["BulletPoints"][0] in r.observation
    r = env.step("click[< prev]")
    assert r.info["page"] == "item"
    r = env.step("click[back to search]")
    assert r.info["page"] == "search" and not r.done and env.steps == 8


def test_expert_wins_and_partial_buy_scores_less():
    env = WebShopEnv()
    tasks = load_tasks("train", 6, source=SMALL)
    for task in tasks:
        r = _expert(env, task)
        assert r.done and r.info["won"] and r.reward == 10.0 and r.info["task_score"] == pytest.approx(1.0)
    task = next(t for t in tasks if t.payload["goal"]["goal_options"])
    r = _expert(env, task, select=False)
    g = task.payload["goal"]
    assert r.done and not r.info["won"] and r.reward == 0.0
    assert r.info["task_score"] == pytest.approx(
        (len(g["attributes"]) + 1) / (len(g["attributes"]) + len(g["goal_options"]) + 1)
    )


@pytest.mark.parametrize(
    "action",
    ["", "search[]", "click[nonexistent]", "jump[x]", "click[buy now]", "购买 红色 衬衫", "search[<your query>]",
     "<action>click[b0]</action>", "click[back to search", None],
)  # fmt: skip
def test_bad_actions_are_invalid_no_ops(action):
    task = load_tasks("test", 1, source=SMALL)[0]
    env = WebShopEnv()
    obs, _ = env.reset(task, 0)
    r = env.step(action)
    assert not r.done and r.reward == 0.0 and not r.info["action_admissible"]
    assert r.observation == obs and env.steps == 1


def test_max_steps_truncates():
    task = load_tasks("test", 1, source=SMALL)[0]
    env = WebShopEnv(max_steps=15)
    env.reset(task, 0)
    env.step("search[shirt]")
    for _ in range(13):
        assert not env.step("click[nothing]").done
    r = env.step("click[nothing]")
    assert r.done and r.reward == 0.0 and r.info["truncated"]
    with pytest.raises(RuntimeError):
        env.step("click[nothing]")


def test_parse_action_forms():
    assert read_action("  click[ Buy  Now ] ") == ("click", "buy now")
    assert read_action("Search[Red Shoes]") == ("search", "red shoes")
    assert read_action("buy now") == (None, None)
    assert read_action("click [a]") == (None, None)  # no space before the bracket
    assert read_action("search[   ]") == (None, None)  # an empty argument is no action


def test_tasks_are_seeded_and_split():
    a, b = load_tasks("train", 5, 0, source=SMALL), load_tasks("train", 5, 0, source=SMALL)
    assert [t.key for t in a] == [t.key for t in b]
    test_keys = {t.key.split("-")[2] for t in load_tasks("test", None, source=SMALL)}
    train_keys = {t.key.split("-")[2] for t in load_tasks("train", None, source=SMALL)}
    assert not test_keys & train_keys and len(test_keys) + len(train_keys) == 40
    assert all(t.env == "webshop" and t.data_source == "text" for t in a)
    with pytest.raises(ValueError, match="split"):
        load_tasks("valid", source=SMALL)


# ------------------------------------------------------------------------------------- original data


def test_original_data_adapter_fixture():
    files = find_original_files(FIXTURE)
    assert Path(files["products"]).name == "items_shuffle_1000.json" and files["human_goals"]
    cat = get_catalogue({"kind": "original", **files})
    assert sorted(cat.by_asin) == ["B07TEA0001", "B07TEA0002", "B08SHOE001", "B09LAMP001"]  # nan and dup skipped
    shoe = cat.by_asin["B08SHOE001"]
    assert shoe["pricing"] == [39.99, 54.99] and shoe["Price"] == "$39.99 to $54.99"
    assert 39.99 <= cat.prices["B08SHOE001"] <= 54.99
    assert shoe["options"]["color"] == ["black | white", "navy"]
    assert cat.by_asin["B09LAMP001"]["pricing"] == [100.0]
    assert len(cat.goals) == 3  # the human goal without attributes is dropped
    tasks = load_tasks("train", None, data_dir=FIXTURE) + load_tasks("test", None, data_dir=FIXTURE)
    assert len(tasks) == 3
    env = WebShopEnv()
    for task in tasks:
        r = _expert(env, task)
        assert r.info["task_score"] == pytest.approx(1.0) and r.reward == 10.0, task.payload["goal"]


def test_original_synthetic_goals_without_human_file():
    files = find_original_files(FIXTURE)
    cat = get_catalogue({"kind": "original", "products": files["products"], "attributes": files["attributes"]})
    tea = [g for g in cat.goals if g["asin"] == "B07TEA0001"]
    assert len(tea) == 4  # flavor x size combinations
    assert all(" with flavor name: " in g["instruction_text"] for g in tea)
    with pytest.raises(ValueError, match="products"):
        get_catalogue({"kind": "original"})


# --------------------------------------------------------------------------------------------- prompts


def test_prompt_with_history_and_long_fallback():
    builder = webshop_prompt()
    ctx = PromptContext(task="buy a lamp", observation="'Search'", admissible_actions=["search[<your query>]"])
    first = builder.render(ctx)
    assert "Your task is to: buy a lamp." in first and "'search[<your query>]'" in first and "<think>" in first
    hist = [("'Search'", "search[lamp]"), ("'Back to Search' [SEP] 'B0X'", "click[b0x]")]
    ctx2 = PromptContext("buy a lamp", "'Buy Now'", ["click[buy now]", "click[< prev]"], hist)
    text = builder.render(ctx2)
    assert "already taken 2 step(s)" in text and "search[lamp]" in text and "'click[buy now]',\n'click[< prev]'" in text
    long_hist = [("x" * 7000, "search[a]"), ("y" * 7000, "search[b]")]
    fallback = builder.render(PromptContext("buy a lamp", "'Search'", ["search[<your query>]"], long_hist))
    assert "already taken" not in fallback and len(fallback) < 13000


def test_manager_runs_webshop_episodes():
    from alignopsd.engine.envs.manager import EnvManager

    with EnvManager("webshop", num_workers=0) as mgr:
        tasks = mgr.task_source("test", 2, source=SMALL)
        prompts, infos = mgr.reset(tasks, group_n=2, seed=0)
        assert len(prompts) == 4 and prompts[0] == prompts[1] and "WebShop" in prompts[0]
        g0 = tasks[0].payload["goal"]
        responses = [
            f"<think>search it</think><action>search[{g0['name']}]</action>",
            "no tags at all",
            "<think>a</think><action>search[x]</action><action>search[y]</action>",
            "<think>这是中文</think><action>search[lamp]</action>",
        ]
        obs, rewards, dones, infos = mgr.step(responses)
        assert [i["is_action_valid"] for i in infos] == [True, False, False, False]
        assert "Page 1" in infos[0]["observation"] and infos[1]["observation"] == "'Search'"
        assert not any(dones) and rewards == [0.0] * 4


def test_skill_bank_covers_categories_and_keywords_fire_on_instructions():
    import json

    from alignopsd.engine.envs.webshop.products import PRODUCT_TYPES

    root = Path(__file__).resolve().parents[2] / "engine" / "envs" / "webshop" / "skills"
    mapping = json.loads((root / "skill_mapping.json").read_text())
    assert set(mapping["task_to_skill"]) == set(PRODUCT_TYPES) == set(mapping["task_keywords"])
    for name, fname in mapping["skill_files"].items():
        assert (root / fname).read_text().startswith("# WebShop"), name
    assert set(mapping["task_to_skill"].values()) | {"general_skills"} == set(mapping["skill_files"])
    products, goals, _ = generate_catalogue(0, n_products=400, n_goals=200)
    for g in goals:  # the instruction names the type: its own category's keywords match it
        own = mapping["task_keywords"][g["category"]]
        assert any(k in g["instruction_text"].lower() for k in own), g["instruction_text"]


def test_generated_catalogue_roundtrips_through_the_original_layout(tmp_path):
    from alignopsd.engine.envs.webshop.data import write_original_layout

    products, goals, _ = generate_catalogue(5, n_products=120, n_goals=12)
    files = write_original_layout(products, goals, tmp_path)
    cat = get_catalogue({"kind": "original", **files})
    assert len(cat.products) == 120 and len(cat.goals) == 12
    for p in products[:20]:
        q = cat.by_asin[p["asin"]]
        for k in ("Title", "Description", "BulletPoints", "pricing", "Price", "options", "Attributes", "query"):
            assert q[k] == p[k], k
    env = WebShopEnv()
    for task in load_tasks("test", None, data_dir=tmp_path):
        assert _expert(env, task).info["task_score"] == pytest.approx(1.0)


def test_skill_lookup_on_rendered_prompts_picks_the_category():
    """The keyword fallback of §1.4 (data_source "text") on real first-turn prompts finds the task's category."""
    from alignopsd.engine.envs.skills import load_skill_bank

    bank = load_skill_bank("webshop")
    env, builder = WebShopEnv(), webshop_prompt()
    for task in load_tasks("test", 30, source=SMALL):
        obs, info = env.reset(task, 0)
        prompt = builder.render(PromptContext(info["task"], obs, info["admissible_actions"]))
        assert bank.match(None, "text", prompt) == [task.category], info["task"]
        assert bank.skill_text(None, "text", prompt).startswith("# WebShop: general shopping skill")
