"""Datasets read through the `datasets` library, offline: a local folder laid out as a Hub
repository (README configs, data files per split), and Hub names routed to load_dataset."""

import json

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gradspec.cli import main
from gradspec.data.errors import InputError
from gradspec.data.readers import Hub, count_records, read_samples

pytest.importorskip("datasets")

README = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*.parquet
  - split: test
    path: data/test-*.parquet
- config_name: chats
  data_files:
  - split: train
    path: chats/train-*.parquet
---
# a dataset laid out as on the Hub
"""


def _rows(prefix, n):
    return [{"instruction": f"{prefix} question {i}", "output": f"{prefix} answer {i}.", "id": f"{prefix}{i}"}
            for i in range(n)]


@pytest.fixture
def repo(tmp_path):
    path = tmp_path / "org__name"
    (path / "data").mkdir(parents=True)
    (path / "chats").mkdir()
    (path / "README.md").write_text(README)
    for split, n in (("train", 5), ("test", 3)):
        pq.write_table(pa.Table.from_pylist(_rows(split, n)), path / f"data/{split}-00000-of-00001.parquet")
    chat = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}
    pq.write_table(pa.Table.from_pylist([chat]), path / "chats/train-00000-of-00001.parquet")
    return path


def test_folder_laid_out_as_a_hub_repository(repo):
    train = list(read_samples(repo))
    assert [s.carried["id"] for s in train] == [f"train{i}" for i in range(5)]
    assert train[2].messages[1] == {"role": "assistant", "content": "train answer 2."}
    test = list(read_samples(repo, hub=Hub("test")))
    assert [s.carried["id"] for s in test] == ["test0", "test1", "test2"] and count_records(repo, Hub("test")) == 3
    [chat] = read_samples(repo, hub=Hub(name="chats"))
    assert chat.messages == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    assert [s.index for s in read_samples(repo, wanted=lambda i: i % 2 == 1)] == [1, 3]


def test_streaming_reads_the_same_rows(repo, tmp_path):
    streamed = list(read_samples(repo, hub=Hub(streaming=True)))
    assert [s.messages for s in streamed] == [s.messages for s in read_samples(repo)]
    assert count_records(repo, Hub(streaming=True)) == 5  # from the Parquet files' metadata
    plain = tmp_path / "plain"  # a folder of JSONL files says nothing of its size until read
    plain.mkdir()
    (plain / "part.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows("p", 4)))
    assert len(list(read_samples(plain, hub=Hub(streaming=True)))) == 4
    with pytest.raises(InputError, match="does not say how many rows split 'train' has: pass limit N"):
        count_records(plain, Hub(streaming=True))


def test_unknown_split_and_config_say_what_there_is(repo):
    with pytest.raises(InputError, match=r"cannot read this folder \(split 'dev'.*test"):
        list(read_samples(repo, hub=Hub("dev")))
    with pytest.raises(InputError, match=r"cannot read this folder .*config 'nope'.*chats"):
        list(read_samples(repo, hub=Hub(name="nope")))


def test_hub_names_go_to_load_dataset(monkeypatch):
    import datasets

    calls = []

    def load_dataset(path, name=None, split=None, streaming=False):
        calls.append((path, name, split, streaming))
        return datasets.Dataset.from_list(_rows("hub", 2))

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    samples = list(read_samples("someone/sft-set", hub=Hub("validation", "main")))
    assert calls == [("someone/sft-set", "main", "validation", False)]
    assert [s.carried["id"] for s in samples] == ["hub0", "hub1"]
    assert count_records("someone/sft-set") == 2
    with pytest.raises(InputError, match="missing.jsonl: no such file or folder"):
        list(read_samples("missing.jsonl"))  # a file name is never taken for a Hub dataset


def test_a_name_the_hub_cannot_give_says_so(monkeypatch):
    import datasets

    def load_dataset(path, name=None, split=None, streaming=False):
        raise datasets.exceptions.DatasetNotFoundError(f"Dataset '{path}' doesn't exist on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(InputError, match="nobody/nothing: datasets.load_dataset cannot read this Hub dataset "
                                         r"\(split 'train', config None\): Dataset 'nobody/nothing' doesn't exist"):
        count_records("nobody/nothing")


def test_an_unreachable_hub_fails_at_once_and_leaves_offline_mode_as_found(monkeypatch):
    """Without a connection the Hub library retries for half a minute; offline mode answers at once."""
    import datasets
    import huggingface_hub.constants as hub_constants

    from gradspec.data import hub

    for name in hub._PROXIES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)

    def no_network(address, timeout=None):
        raise OSError("Name or service not known")

    monkeypatch.setattr(hub.socket, "create_connection", no_network)
    real, offline_at_call = datasets.load_dataset, []

    def load_dataset(*args, **kwargs):
        offline_at_call.append((hub_constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE))
        return real(*args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(InputError, match="nobody/nothing: datasets.load_dataset cannot read this Hub dataset .*"
                                         "the Hub is not reachable from this machine: only datasets in the local "
                                         "cache load offline"):
        count_records("nobody/nothing")
    assert offline_at_call == [(True, True)]  # the network is not tried
    assert hub_constants.HF_HUB_OFFLINE is False and datasets.config.HF_HUB_OFFLINE is False


def test_a_run_loads_its_dataset_once(monkeypatch, tmp_path, tiny_model_dir):
    """A run reads the size, the first row and the rows: one load_dataset (each asks the Hub)."""
    import datasets

    calls = []

    def load_dataset(path, name=None, split=None, streaming=False):
        calls.append(path)
        return datasets.Dataset.from_list(_rows("hub", 3))

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    out = tmp_path / "s.parquet"
    assert main(["score", "--model", str(tiny_model_dir), "--data", "someone/sft-set", "--out", str(out),
                 "--quiet"]) == 0
    assert calls == ["someone/sft-set"] and pd.read_parquet(out)["id"].tolist() == ["hub0", "hub1", "hub2"]


def test_score_a_split_from_the_command_line(repo, tmp_path, tiny_model_dir):
    out = tmp_path / "s.parquet"
    assert main(["score", "--model", str(tiny_model_dir), "--data", str(repo), "--split", "test", "--out", str(out),
                 "--quiet"]) == 0
    df = pd.read_parquet(out)
    assert df["id"].tolist() == ["test0", "test1", "test2"] and (df["status"] == "ok").all()
    meta = json.loads(pq.read_schema(out).metadata[b"gradspec"])
    assert meta["hub"] == {"split": "test", "name": None, "streaming": False}
    out2 = tmp_path / "chats.parquet"
    assert main(["score", "--model", str(tiny_model_dir), "--data", str(repo), "--config-name", "chats",
                 "--streaming", "--limit", "1", "--out", str(out2), "--quiet"]) == 0
    assert pd.read_parquet(out2)["status"].tolist() == ["ok"]


def test_without_datasets_a_hub_id_says_the_one_command_before_the_model_loads(monkeypatch, tmp_path, capsys):
    """datasets is optional: a Hub id given without it stops at once, naming the install command."""
    import sys

    import gradspec.data.models

    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    monkeypatch.setattr(gradspec.data.models, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    monkeypatch.setattr("gradspec.runs.scoring.load_model", lambda *a, **k: pytest.fail("the model loaded"))
    assert main(["score", "--data", "org/some-dataset", "--out", str(tmp_path / "s.parquet"), "--quiet"]) == 2
    assert "org/some-dataset: reading it needs the datasets library: pip install datasets" in capsys.readouterr().err
