"""`gradspec diagnose` on a planted experiment: a tiny character-level Llama is pre-trained on some
facts, then fine-tuned in two stages on data with planted causes of incomplete learning."""

import json
import math
import random
import string

import pandas as pd
import pytest
import torch

from gradspec.cli import main
from gradspec.data.batching import pad_batch
from gradspec.data.readers import Sample
from gradspec.data.templates import tokenize
from gradspec.diagnose.diagnosis import CAUSES, Thresholds, attribute, detect, nearest, rouge_l
from gradspec.diagnose.report import write_diagnosis


def test_rouge_l_on_tokens():
    assert rouge_l([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert rouge_l([1, 9, 3, 4], [1, 2, 3, 4]) == pytest.approx(0.75)  # LCS 3 of 4 and 4
    assert rouge_l([1, 2], [1, 2, 3, 4]) == pytest.approx(2 * 2 / 6)
    assert rouge_l([], [1]) == 0.0 and rouge_l([], []) == 1.0


def test_nearest_neighbours_blockwise_match_the_full_matrix():
    embeddings = torch.nn.functional.normalize(torch.randn(50, 8, dtype=torch.float64), dim=1)
    full = embeddings @ embeddings.T
    full.fill_diagonal_(-math.inf)
    want = torch.topk(full, 5, dim=1).indices.numpy()
    assert (nearest(embeddings, 5, block=7) == want).all()


def test_attribution_takes_the_first_matching_cause():
    row = {"index": 0, "unlearned": True, "token_accuracy": 0.2, "loss": 2.0, "nearest_prompt_similarity": 0.5,
           "nearest_response_rouge_l": 0.9, "base_prompt_perplexity": 5.0, "base_confident_disagreement": 0.0,
           "js_divergence": 0.0, "base_token_prob": 0.9}
    table = pd.DataFrame([
        {**row, "index": 0, "nearest_prompt_similarity": 1.0, "nearest_response_rouge_l": 0.1},  # duplicate prompt
        {**row, "index": 1},  # learned at checkpoint 1, lost since
        {**row, "index": 2, "base_prompt_perplexity": 1.1, "base_confident_disagreement": 0.8, "js_divergence": 0.5},
        {**row, "index": 3, "base_prompt_perplexity": 9.0, "base_token_prob": 0.01},
        {**row, "index": 4},
        {**row, "index": 5, "unlearned": False},
    ])
    dynamics = pd.DataFrame({"index": range(6), "token_accuracy": [[0.1], [1.0], [0.1], [0.1], [0.1], [1.0]],
                             "perplexity": [[9.0]] * 6})
    causes = attribute(table, dynamics)["cause"].tolist()
    assert causes[:5] == list(CAUSES) and pd.isna(causes[5])
    blind = attribute(table)  # no checkpoints: forgetting is not assessed, not found absent
    assert blind["learned_before"].isna().all() and blind["loss_falling"].isna().all()
    assert "forgetting" not in blind["cause"].tolist()


def _char_tokenizer():
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(set(string.ascii_letters + string.digits + " ?.\n")))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def _plant():
    """(facts with their planted cause, in training order; the pre-training facts; stage-1 facts)."""
    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "zu", "ve", "ro", "ta", "ni", "pe", "su", "do", "ra", "fi", "gu", "he", "jo"]
    used = set()

    def name():
        while (n := "".join(rng.choice(syllables) for _ in range(3)).capitalize()) in used:
            pass
        used.add(n)
        return n

    def code():
        return "".join(rng.choice(string.digits) for _ in range(4))

    known = [(name(), code()) for _ in range(8)]
    conflict_names = [name() for _ in range(6)]
    pretrained = known + [(n, code()) for n in conflict_names]
    forgotten = [(name(), code()) for _ in range(6)]
    twins = [name() for _ in range(4)]
    stage2 = ([(f, "learned") for f in known] + [((n, code()), "pretraining_conflict") for n in conflict_names]
              + [((name(), code()), "missing_knowledge") for _ in range(6)]
              + [((n, code()), "inconsistent_data") for n in twins + twins])
    return [(f, "forgetting") for f in forgotten] + stage2, pretrained, forgotten + known


def _messages(fact):
    return [{"role": "user", "content": f"What is the secret code of {fact[0]}?"},
            {"role": "assistant", "content": fact[1]}]


def _train(model, tokenizer, facts, epochs, lr, whole_text=False):
    tokens = [tokenize(_messages(f), tokenizer) for f in facts]
    ids, mask, labels = pad_batch(tokens, tokenizer.pad_token_id, "cpu")
    if whole_text:  # pre-training: every token is a target
        labels = torch.where(mask.bool(), ids, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(epochs):
        optimizer.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
    model.eval()


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("planted")
    tokenizer = _char_tokenizer()
    data, pretrained, stage1 = _plant()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         hidden_size=128, intermediate_size=256, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    folders = {}

    def save(stage):
        folders[stage] = root / stage
        model.save_pretrained(folders[stage])
        tokenizer.save_pretrained(folders[stage])

    _train(model, tokenizer, pretrained, 300, 3e-3, whole_text=True)
    save("base")
    _train(model, tokenizer, stage1, 60, 2e-3)
    save("stage1")
    _train(model, tokenizer, [f for f, kind in data if kind != "forgetting"], 6, 2e-3)
    save("final")
    path = root / "train.jsonl"
    path.write_text("".join(json.dumps({"instruction": m[0]["content"], "output": m[1]["content"]}) + "\n"
                            for m in (_messages(f) for f, _ in data)))
    scores = root / "scores.parquet"
    assert main(["score", "--model", str(folders["final"]), "--data", str(path), "--out", str(scores), "--quiet"]) == 0
    out = root / "diagnosis"
    # Responses are 4-digit codes: reproduced means exactly, and any other code diverges
    assert main(["diagnose", "--base", str(folders["base"]), "--model", str(folders["final"]), "--data", str(path),
                 "--checkpoints", str(folders["stage1"]), "--out", str(out), "--reproduced-rouge", "0.9",
                 "--divergent-rouge", "0.9", "--scores", str(scores)]) == 0
    table = pd.read_parquet(out / "diagnosis.parquet")
    table["planted"] = [kind for _, kind in data]
    return table, out


def test_planted_causes_are_found(planted):
    """Measured on this setup (seed 0): right cause for forgetting 5/6, inconsistent data 6/8 (every
    contradicting pair has a member flagged as such), pretraining conflict 5/6, missing knowledge
    5/6: 21 of 26 planted samples. Of the 8 known facts (pre-trained, and trained in both stages),
    5 end up unlearned too: they were learned at the stage-1 checkpoint and lost in stage 2, and
    are called forgetting, which is what happened to them."""
    table, _ = planted
    right = table[table["cause"] == table["planted"]].groupby("planted").size()
    total = table.groupby("planted").size()
    accuracy = (right / total).fillna(0)
    print(accuracy.to_dict())
    assert accuracy["forgetting"] > 0.5
    assert accuracy["pretraining_conflict"] > 0.5
    pairs = table[table["planted"] == "inconsistent_data"].assign(pair=lambda d: d.index % 4)
    assert (pairs.groupby("pair")["cause"].apply(lambda c: (c == "inconsistent_data").any())).all()
    assert accuracy["missing_knowledge"] > 0.5
    planted_rows = table[table["planted"] != "learned"]
    assert (planted_rows["cause"] == planted_rows["planted"]).mean() > 0.7
    known = table[(table["planted"] == "learned") & table["unlearned"]]
    assert (known["cause"] == "forgetting").all() and known["learned_before"].all()


def test_report_explains_each_cause(planted):
    table, out = planted
    assert table["spectral_effective_rank"].gt(1).all()  # gradient spectra joined as evidence
    report = (out / "report.md").read_text()
    n = int(table["unlearned"].sum())
    assert f"{n} of {len(table)} training samples" in report
    for heading in ("## Forgetting", "## Inconsistent data", "## Conflict with pre-training",
                    "What helps: Shuffle globally", "| cause | samples | share of unlearned | what helps |"):
        assert heading in report


def test_diagnose_stops_when_the_tokenizer_leaves_no_response_tokens(tmp_path, one_token_model_dir, capsys):
    """Every text is one token, so no sample has a response token: no verdict on any of them
    (the old output called every row unlearned, under-training), but an error naming the cause."""
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"instruction": m[0]["content"], "output": m[1]["content"]}) + "\n"
                            for m in (_messages((f"Kalomi{k}", "1234")) for k in range(3))))
    model = str(one_token_model_dir)
    assert main(["diagnose", "--base", model, "--model", model, "--data", str(path), "--out",
                 str(tmp_path / "diagnosis")]) == 2
    assert ("3 of 3 rows have no response tokens (no_response_tokens 3): check the tokenizer and --template"
            in capsys.readouterr().err)
    assert not (tmp_path / "diagnosis").exists()


def test_a_sample_without_response_tokens_is_flagged_not_judged(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _char_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, hidden_size=32, intermediate_size=64,
                                         pad_token_id=tokenizer.pad_token_id)).eval()
    facts = [("Kalomi", "1234"), ("Zuveta", "5678"), ("Rotani", "9012"), ("Pe" * 40, "3456")]
    samples = [Sample(k, _messages(f)) for k, f in enumerate(facts)]
    table = detect(model, model, tokenizer, samples, max_length=40, thresholds=Thresholds(repetitions=1))
    assert table["status"].tolist() == ["ok", "ok", "ok", "prompt_too_long"]
    assert table["unlearned"].isna().tolist() == [False, False, False, True]
    assert table.loc[3, ["token_accuracy", "rouge_l", "loss"]].isna().all()
    table = attribute(table)
    assert pd.isna(table.loc[3, "cause"])
    report = write_diagnosis(table, samples, tmp_path / "d").read_text()
    assert f"{int(table['unlearned'].sum())} of 3 training samples" in report
    assert "1 more samples were not judged: they have no response token to score (1 `prompt_too_long`" in report
    assert "| not assessed | | needs earlier checkpoints: --checkpoints or --dynamics |" in report
