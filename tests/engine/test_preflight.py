"""Pre-flight check: devices, launch, paths, env.options and official data, before anything heavy loads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from alignopsd.engine.config.errors import README_HINT
from alignopsd.engine.config.preflight import env_option_names, preflight
from alignopsd.engine.config.schema import ConfigError, load_config
from alignopsd.engine.envs.alfworld.env import load_tasks as alfworld_load_tasks
from alignopsd.engine.envs.alfworld.official import alfworld_official_data
from alignopsd.engine.envs.search.env import load_tasks as search_load_tasks
from alignopsd.engine.envs.search.official import search_official_data
from alignopsd.engine.envs.search.retriever import URL_ENV_VAR
from alignopsd.engine.envs.webshop.official import webshop_official_data

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}


def _cfg(*overrides):
    return load_config(TINY, list(overrides))


def test_tiny_config_passes():
    preflight(_cfg(), env={})
    preflight(_cfg("env.options={startup_timeout: 30}"), env={})


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda():
    with pytest.raises(ConfigError, match="trainer.device: 'cuda' requested but CUDA is not available"):
        preflight(_cfg("trainer.device=cuda"), env={})


def test_megatron_needs_torchrun():
    cfg = _cfg("policy.backend=megatron")
    with pytest.raises(ConfigError, match="policy.backend: 'megatron' needs the distributed environment.*torchrun"):
        preflight(cfg, env={})
    with pytest.raises(ConfigError, match="WORLD_SIZE=2 without the rest"):
        preflight(_cfg(), env={"WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="policy.tensor_parallel_size: 2 does not divide the number of processes 3"):
        preflight(_cfg("policy.backend=megatron", "policy.tensor_parallel_size=2"), env={**TORCHRUN, "WORLD_SIZE": "3"})
    preflight(_cfg("policy.backend=megatron", "policy.tensor_parallel_size=2"), env=TORCHRUN)


def test_paths_that_must_exist(tmp_path):
    with pytest.raises(ConfigError, match="model.name: .*no such directory"):
        preflight(_cfg(f"model.name={tmp_path / 'nope'}"), env={})
    with pytest.raises(ConfigError, match="model.name: .*not in the local Hugging Face cache"):
        preflight(_cfg("model.name=nobody-here/no-such-model-xyz"), env={})
    with pytest.raises(ConfigError, match="model.tokenizer: .*no such directory"):
        preflight(_cfg(f"model.tokenizer={tmp_path / 'tok'}"), env={})
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="model.name: .*no config.json"):
        preflight(_cfg(f"model.name={tmp_path / 'empty'}"), env={})
    with pytest.raises(ConfigError, match="env.data_dir: no such directory"):
        preflight(_cfg(f"env.data_dir={tmp_path / 'data'}"), env={})


def test_encoder_path_checked_when_the_estimator_uses_it(tmp_path):
    missing = f"encoder.name={tmp_path / 'enc'}"
    with pytest.raises(ConfigError, match="encoder.name: "):
        preflight(_cfg(missing), env={})  # tiny.yaml runs alignopsd (Mechanism 1 encodes thinking)
    preflight(_cfg(missing, "algorithm.estimator=grpo"), env={})  # GRPO never builds the encoder


def test_unknown_env_options():
    with pytest.raises(ConfigError, match="env.options.scale: unknown option of environment 'codeword'"):
        preflight(_cfg("env.options={scale: 2}"), env={})
    with pytest.raises(ConfigError, match="env.options.max_steps: set by env.max_turns"):
        preflight(_cfg("env.options={max_steps: 3}"), env={})
    assert {"retriever_url", "topk", "mp_context"} <= set(env_option_names("search"))
    assert "cache_dir" in env_option_names("alfworld") and "cache_dir" not in env_option_names("search")


# ------------------------------------------------------------------------------------------ official data

CONFIGS = TINY.parent
PAPER = ["alfworld_3b", "alfworld_7b", "webshop_3b", "webshop_7b", "search_3b", "search_7b"]


def _alfworld_data(root: Path, splits=("train", "valid_seen")) -> Path:
    for split in splits:
        trial = root / "json_2.1.1" / split / "pick_and_place_simple-Apple-None-Fridge-1" / "trial_T0"
        trial.mkdir(parents=True)
        (trial / "traj_data.json").write_text(json.dumps({"task_type": "pick_and_place_simple"}))
        (trial / "game.tw-pddl").write_text(json.dumps({"solvable": True}))
    return root


def _webshop_data(root: Path, names=("items_shuffle.json", "items_ins_v2.json", "items_human_ins.json")) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        (root / name).write_text("{}")
    return root


def _search_data(root: Path, splits=("train", "test")) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for split in splits:
        pq.write_table(
            pa.table({"id": ["q0"], "question": ["who?"], "golden_answers": [["me"]], "data_source": ["nq"]}),
            root / f"{split}.parquet",
        )
    return root


def test_alfworld_official_data(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # alfworld's default folder, empty
    with pytest.raises(ConfigError, match=r"official data not found .*ALFWORLD_DATA are unset.*Running the paper"):
        alfworld_official_data(None, ("train", "valid_seen"), {})
    root = _alfworld_data(tmp_path / "alf")
    assert alfworld_official_data(None, ("train", "valid_seen"), {"ALFWORLD_DATA": str(root)}) == root
    assert alfworld_official_data(str(root), ("train", "valid_seen"), {}) == root
    with pytest.raises(ConfigError, match=r"ALFWORLD_DATA=.*nowhere has no json_2.1.1 folder"):
        alfworld_official_data(None, ("train",), {"ALFWORLD_DATA": str(tmp_path / "nowhere")})
    with pytest.raises(ConfigError, match=r"env.data_dir=.*nowhere has no json_2.1.1"):
        alfworld_official_data(str(tmp_path / "nowhere"), ("train",), {"ALFWORLD_DATA": str(root)})
    partial = _alfworld_data(tmp_path / "partial", splits=("train",))
    with pytest.raises(ConfigError, match=r"no ALFWorld games of split 'valid_seen' in .*partial"):
        alfworld_official_data(str(partial), ("train", "valid_seen"), {})
    # downloaded to alfworld's default folder but not pointed at: the loader would generate, so refuse
    _alfworld_data(tmp_path / "home" / ".cache" / "alfworld")
    with pytest.raises(ConfigError, match=r"alfworld's default folder .*export ALFWORLD_DATA="):
        alfworld_official_data(None, ("train",), {})


def test_alfworld_check_accepts_what_the_loader_reads_as_official(tmp_path, monkeypatch):
    root = _alfworld_data(tmp_path / "alf")
    monkeypatch.setenv("ALFWORLD_DATA", str(root))
    assert alfworld_official_data(None, ("train",), dict(os.environ)) == root
    tasks = alfworld_load_tasks("train", n=2, data_dir=None)
    assert {t.payload["source"] for t in tasks} == {"official"} and tasks[0].payload["gamefile"].startswith(str(root))


def test_webshop_official_data(tmp_path):
    with pytest.raises(ConfigError, match=r"env.data_dir is unset, so the run would train on the generated catalogue"):
        webshop_official_data(None)
    with pytest.raises(ConfigError, match=r"not a directory"):
        webshop_official_data(str(tmp_path / "nowhere"))
    only_products = _webshop_data(tmp_path / "p", names=("items_shuffle_1000.json",))
    with pytest.raises(ConfigError, match=r"no items_ins_v2\*\.json in .*items_human_ins.json from WebShop's setup"):
        webshop_official_data(str(only_products))
    no_human = _webshop_data(tmp_path / "h", names=("items_shuffle.json", "items_ins_v2.json"))
    with pytest.raises(ConfigError, match=r"no items_human_ins\*\.json"):
        webshop_official_data(str(no_human))
    with pytest.raises(ConfigError, match=r"no items_shuffle\*\.json"):
        webshop_official_data(str(_webshop_data(tmp_path / "s", names=("items_ins_v2.json",))))
    found = webshop_official_data(str(_webshop_data(tmp_path / "full")))
    assert found["products"].endswith("items_shuffle.json") and found["human_goals"].endswith("items_human_ins.json")


def test_search_official_data(tmp_path):
    url = {"retriever_url": "http://127.0.0.1:8000/retrieve"}
    with pytest.raises(ConfigError, match=r"env.data_dir is unset, so the run would train on the generated knowledge"):
        search_official_data(None, ("train", "test"), url, {})
    partial = _search_data(tmp_path / "partial", splits=("train",))
    with pytest.raises(ConfigError, match=r"no test.parquet in .*partial"):
        search_official_data(str(partial), ("train", "test"), url, {})
    data = _search_data(tmp_path / "sr1")
    with pytest.raises(ConfigError, match=r"no retriever for the Search-R1 corpus; set env.options.retriever_url"):
        search_official_data(str(data), ("train", "test"), {}, {})
    with pytest.raises(ConfigError, match=r"no retriever"):  # in-process retrieval needs the corpus file
        search_official_data(str(data), ("train", "test"), {"retriever_url": "local"}, {})
    with pytest.raises(ConfigError, match=r"env.options.corpus_path: no such file"):
        search_official_data(str(data), ("train",), {"corpus_path": str(tmp_path / "wiki-18.jsonl")}, {})
    with pytest.raises(ConfigError, match=r"env.options.retriever_url: expected an http\(s\) URL"):
        search_official_data(str(data), ("train",), {"retriever_url": "127.0.0.1:8000"}, {})
    assert search_official_data(str(data), ("train", "test"), url, {})["retriever_url"] == url["retriever_url"]
    assert "test" in search_official_data(str(data), ("train", "test"), {}, {URL_ENV_VAR: url["retriever_url"]})
    (tmp_path / "wiki-18.jsonl").write_text('{"id": "0", "contents": "\\"T\\"\\nx"}\n')
    found = search_official_data(str(data), ("train",), {"corpus_path": str(tmp_path / "wiki-18.jsonl")}, {})
    assert found["corpus_path"].endswith("wiki-18.jsonl")
    rows = search_load_tasks("train", data_dir=found["train"].rsplit("/", 1)[0])  # what the loader then reads
    assert [t.payload["question"] for t in rows] == ["who?"]


def _paper(name, tmp_path, *overrides):
    model = tmp_path / "Qwen2.5"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return load_config(
        CONFIGS / f"{name}.yaml", ["trainer.device=cpu", f"model.name={model}", f"encoder.name={model}", *overrides]
    )


@pytest.mark.parametrize("name", PAPER)
def test_paper_profiles_refuse_without_official_data(name, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = _paper(name, tmp_path)
    assert cfg.env.require_official_data
    launch = {**TORCHRUN, "WORLD_SIZE": str(cfg.policy.tensor_parallel_size)}
    with pytest.raises(ConfigError, match=r"^env.require_official_data: .*Running the paper's experiments"):
        preflight(cfg, env=launch)
    preflight(_paper(name, tmp_path, "env.require_official_data=false"), env=launch)  # generated data allowed
    data = {"alfworld": _alfworld_data, "webshop": _webshop_data, "search": _search_data}[cfg.env.name]
    root = data(tmp_path / "data")
    opts = ["env.options.retriever_url=http://127.0.0.1:8000/retrieve"] if cfg.env.name == "search" else []
    preflight(_paper(name, tmp_path, f"env.data_dir={root}", *opts), env=launch)
    with pytest.raises(ConfigError, match=r"model.name: .*not in the local Hugging Face cache.*Running the paper's"):
        preflight(_paper(name, tmp_path, f"env.data_dir={root}", "model.name=nobody-here/Qwen-xyz", *opts), env=launch)


def test_official_data_only_for_the_benchmarks():
    with pytest.raises(ConfigError, match=r"environment 'codeword' has no official data; it applies to alfworld"):
        preflight(_cfg("env.require_official_data=true"), env={})


def test_messages_point_to_a_readme_section_that_exists():
    readme = (CONFIGS.parent / "README.md").read_text()
    assert "\n## Running the paper's experiments\n" in readme and "Running the paper's experiments" in README_HINT
    assert "env.require_official_data" in readme
