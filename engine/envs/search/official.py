"""Search-R1's official data: the question splits and a retriever over its corpus.

The check of ``env.require_official_data`` (engine/config/preflight.py): it mirrors where the task loader looks
and raises a ConfigError where that loader would instead use its generated knowledge base
(or fail later, after the models loaded).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from alignopsd.engine.envs.official import OfficialDataQuery, official_data_error
from alignopsd.engine.envs.search.retriever import URL_ENV_VAR


def search_official_data(
    data_dir: str | None, splits: tuple[str, ...], options: Mapping[str, object], env: Mapping[str, str]
) -> dict[str, str]:
    """Search-R1's ``<split>.parquet`` files in ``env.data_dir`` (engine/envs/search/env.py load_tasks) and a
    retriever for its corpus: ``env.options.retriever_url`` (a Search-R1 ``/retrieve`` server),
    ``env.options.corpus_path`` (the corpus jsonl; the engine serves it), or ``$ALIGNOPSD_RETRIEVER_URL``."""

    if not data_dir:
        raise official_data_error(
            "env.data_dir is unset, so the run would train on the generated knowledge base",
            "set env.data_dir to the folder holding Search-R1's train.parquet and test.parquet",
        )
    out: dict[str, str] = {}
    for split in splits:
        path = Path(data_dir).expanduser() / f"{split}.parquet"
        if not path.is_file():
            raise official_data_error(
                f"env.data_dir: no {split}.parquet in {data_dir}",
                "env.data_dir must hold the train.parquet and test.parquet that Search-R1's "
                "scripts/data_process/qa_search_{train,test}_merge.py write",
            )
        out[split] = str(path)
    url, corpus = options.get("retriever_url"), options.get("corpus_path")
    retriever = "set env.options.retriever_url to a running Search-R1 retrieval server, or env.options.corpus_path"
    if corpus is not None:
        if not Path(str(corpus)).expanduser().is_file():
            raise official_data_error(f"env.options.corpus_path: no such file {corpus}", retriever)
        out["corpus_path"] = str(corpus)
    elif url == "local" or not (url or env.get(URL_ENV_VAR)):
        raise official_data_error("no retriever for the Search-R1 corpus", f"{retriever} to its corpus jsonl")
    if url and url != "local":
        if not str(url).startswith(("http://", "https://")):
            raise official_data_error(f"env.options.retriever_url: expected an http(s) URL, got {url!r}", retriever)
        out["retriever_url"] = str(url)
    return out


def check_official_data(query: OfficialDataQuery, environ: Mapping[str, str]) -> None:
    """The registry entry's ``official_data`` check: the run's data place and splits (``query``)."""
    search_official_data(query.data_dir, query.splits, query.options, environ)
