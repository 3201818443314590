"""lm-evaluation-harness' ``local-completions`` model against the server, on two tiny local tasks: a
``generate_until`` task with stop sequences and a multiple-choice (loglikelihood: echo + prompt log-probs) task;
and ``local-chat-completions`` (chat has no log-likelihoods) on the generation task.  Each completes with one
scored sample per document; a model first trained on the multiple-choice answers scores every one of them right
(chance is 1/3), so the log-likelihoods lm-eval gets are of the right tokens."""

import json
import math
import os

import pytest
import torch

from megalite.data.tokenizer import build_tokenizer
from tests.data.megatron_fixture import FIXTURE_DIR
from tests.inference.common import tiny_model
from tests.inference.server_harness import Server

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("datasets")
pytest.importorskip("tenacity")  # lm-eval[api], which local-completions needs

TASKS = {
    "megalite_tiny_gen": """
task: megalite_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", ". "]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
""",
    "megalite_tiny_mc": """
task: megalite_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
""",
}


MC_SUMS = [(2, 3), (4, 1), (5, 2), (1, 1)]
"""The multiple-choice task's questions ``a+b=``; its choices are ``a+b`` (the answer), ``a+b+1`` and ``a*b+3``."""


def _train_on_answers(model, tokenizer, steps: int = 50):
    """Fit ``model`` (Adam, full batch) to the multiple-choice questions followed by their answers, tokenized as
    lm-eval's ``local-completions`` joins them (context, then the target after a space); returns it in eval mode."""
    sequences = [tokenizer.tokenize(f"{a}+{b}=") + tokenizer.tokenize(f" {a + b}") for a, b in MC_SUMS]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = sum(torch.nn.functional.cross_entropy(model(torch.tensor([s[:-1]]))[0].float(), torch.tensor(s[1:]))
                   for s in sequences)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def _write_tasks(tmp_path):
    """The two tasks' data and YAML files under ``tmp_path``."""
    with open(tmp_path / "gen.jsonl", "w") as f:
        for a, b in [(2, 3), (4, 1), (5, 2)]:
            f.write(json.dumps({"question": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    with open(tmp_path / "mc.jsonl", "w") as f:
        for a, b in MC_SUMS:
            choices = [str(a + b), str(a + b + 1), str(a * b + 3)]
            f.write(json.dumps({"question": f"{a}+{b}=", "choices": choices, "label": 0}) + "\n")
    for name, text in TASKS.items():
        (tmp_path / f"{name}.yaml").write_text(text.format(dir=tmp_path))


@pytest.mark.slow
def test_local_completions_runs_generation_and_multiple_choice_tasks(tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    _write_tasks(tmp_path)
    hf_dir = os.path.join(FIXTURE_DIR, "hf_tokenizer")
    tokenizer = build_tokenizer(hf_dir, "HuggingFaceTokenizer")
    model = _train_on_answers(tiny_model(vocab_size=tokenizer.vocab_size, max_position_embeddings=256), tokenizer)
    with Server(model, tokenizer=tokenizer) as server:
        results = simple_evaluate(
            model="local-completions",
            model_args=f"base_url={server.url}/v1/completions,model=megalite,tokenizer={hf_dir},"
                       "tokenizer_backend=huggingface,max_length=200,num_concurrent=1",
            tasks=list(TASKS), task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True,
            bootstrap_iters=0)
        assert server.idle()
    assert 0.0 <= results["results"]["megalite_tiny_gen"]["exact_match,none"] <= 1.0
    assert results["results"]["megalite_tiny_mc"]["acc,none"] == 1.0  # trained on the answers; chance is 1/3
    gen, mc = results["samples"]["megalite_tiny_gen"], results["samples"]["megalite_tiny_mc"]
    assert len(gen) == 3 and len(mc) == 4
    assert all(isinstance(s["filtered_resps"][0], str) and "\n" not in s["filtered_resps"][0] for s in gen)
    for sample in mc:
        scores = [resp[0][0] for resp in sample["resps"]]
        assert len(scores) == 3 and all(math.isfinite(x) and x < 0 for x in scores)


@pytest.mark.slow
def test_local_chat_completions_runs_the_generation_task(tmp_path):
    """``local-chat-completions`` (messages rendered by the server's chat template, stop sequences, seed)
    completes the generate_until task with one reply per document, each cut at its stop sequences."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from megalite.inference.chat_template import ChatTemplate

    _write_tasks(tmp_path)
    tokenizer = build_tokenizer(os.path.join(FIXTURE_DIR, "hf_tokenizer"), "HuggingFaceTokenizer")
    model = tiny_model(vocab_size=tokenizer.vocab_size, max_position_embeddings=256)
    template = ChatTemplate("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                            "{% if add_generation_prompt %}assistant:{% endif %}")
    with Server(model, tokenizer=tokenizer, chat_template=template) as server:
        results = simple_evaluate(
            model="local-chat-completions",
            model_args=f"base_url={server.url}/v1/chat/completions,model=megalite,num_concurrent=1",
            tasks=["megalite_tiny_gen"], task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True,
            apply_chat_template=True, bootstrap_iters=0)
        assert server.idle()
    assert 0.0 <= results["results"]["megalite_tiny_gen"]["exact_match,none"] <= 1.0
    gen = results["samples"]["megalite_tiny_gen"]
    assert len(gen) == 3
    assert all(isinstance(s["filtered_resps"][0], str) and "\n" not in s["filtered_resps"][0] for s in gen)
