"""``hf-zero push`` / ``hf-zero pull`` and ``hf_zero.hub.transfer`` against a Hub-compatible server on 127.0.0.1.

The client side always runs in a fresh subprocess: ``huggingface_hub`` reads ``HF_ENDPOINT``,
``HF_HUB_DISABLE_XET`` and ``HF_HOME`` into module constants when it is first imported, and
pytest (through transformers and the other tests) may have imported it already, pointing at
the real Hub. Each subprocess gets an empty ``HF_HOME`` so nothing comes from a cache.

The oracle: the files pulled are byte-identical to the files pushed, and a model loaded with
``from_pretrained("user/tiny")`` has exactly the original state dict. The server requires the
token on every API request, so a passing test shows the token is sent; the token is then looked
for in every output, every file written and every request body, where it must never appear.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.hub_server import HubServer

REPO_ROOT = Path(__file__).resolve().parent.parent
ZERO_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 3},
    "bf16": {"enabled": True},
}


# ------------------------------------------------------------------------------ fixtures


class Client:
    """Runs client code in subprocesses pointed at the server; keeps every output for the token check."""

    def __init__(self, hub: HubServer, root: Path):
        self.hub, self.root = hub, root
        self.outputs: list[str] = []
        self._homes = 0

    def env(self, token: str | None = None) -> dict[str, str]:
        self._homes += 1
        home = self.root / f"hf_home{self._homes}"
        home.mkdir()
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("HF_", "HUGGING_FACE_", "HUGGINGFACE_", "TRANSFORMERS_"))
        }
        env.update(
            HF_ENDPOINT=self.hub.url,
            HF_HUB_DISABLE_XET="1",
            HF_HOME=str(home),
            HF_TOKEN=token or self.hub.token,
            HF_HUB_DISABLE_PROGRESS_BARS="1",
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(REPO_ROOT),
        )
        return env

    def run(self, argv: list[str], token: str | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            argv, cwd=self.root, env=self.env(token), capture_output=True, text=True, timeout=120
        )
        self.outputs += [proc.stdout, proc.stderr]
        return proc

    def cli(self, *args: str, token: str | None = None) -> subprocess.CompletedProcess:
        return self.run([sys.executable, "-m", "hf_zero.launch.cli", *args], token=token)

    def python(self, code: str, token: str | None = None) -> subprocess.CompletedProcess:
        return self.run([sys.executable, "-c", textwrap.dedent(code)], token=token)


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def hub():
    server = HubServer(token="hf_" + secrets.token_hex(16), page_size=4).start()
    yield server
    server.stop()
    assert not server.unknown_calls, server.unknown_calls


@pytest.fixture(autouse=True)
def no_unknown_calls(hub: HubServer):
    """Fail the test that made a request the server does not model (it was answered 501)."""
    yield
    calls = list(hub.unknown_calls)
    hub.unknown_calls.clear()
    assert not calls, f"requests the Hub test server does not implement: {calls}"


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hub")


@pytest.fixture(scope="module")
def client(hub: HubServer, work: Path) -> Client:
    return Client(hub, work)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def pushed(client: Client, model: torch.nn.Module, work: Path) -> dict[str, Path]:
    """Two repos: ``user/tiny`` (one weight file, pushed by the CLI) and ``user/tiny-sharded``
    (several shards and an index, plus resume state that must stay local, pushed through the
    Python API with model-card details)."""
    single, sharded = work / "single", work / "sharded"
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="40KB")
    assert (
        len(list(sharded.glob("model-*.safetensors"))) > 1
        and (sharded / "model.safetensors.index.json").exists()
    )
    (sharded / "global_step7").mkdir()
    (sharded / "global_step7" / "checkpoint.json").write_text("{}")
    (sharded / "latest").write_text("global_step7")

    out = _ok(client.cli("push", str(single), "user/tiny", "--commit-message", "first push"))
    repo = client.hub.repos["user/tiny"]
    assert repo.commits[repo.refs["main"]].title == "first push" and repo.refs["main"] in out.stdout
    _ok(
        client.python(f"""
        from hf_zero.hub.transfer import push_to_hub
        print(push_to_hub({str(sharded)!r}, "user/tiny-sharded", card_kwargs=dict(
            base_model="meta-llama/Tiny", datasets=["user/sentences"], metrics={{"accuracy": 0.75}},
            zero_config={ZERO_CONFIG!r}, hardware="2 x CPU (gloo)", throughput=1234.5)))
    """)
    )
    return {"user/tiny": single, "user/tiny-sharded": sharded}


def _files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in folder.rglob("*")
        if p.is_file() and ".cache" not in p.relative_to(folder).parts
    }


# ------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("repo_id", ["user/tiny", "user/tiny-sharded"])
def test_pull_gives_the_pushed_files_byte_for_byte(
    repo_id: str, pushed: dict, client: Client, work: Path, hub: HubServer
) -> None:
    dest = work / f"pulled-{repo_id.replace('/', '_')}"
    out = _ok(client.cli("pull", repo_id, str(dest)))
    assert str(dest) in out.stdout
    sent = {
        k: v for k, v in _files(pushed[repo_id]).items() if not k.startswith("global_step") and k != "latest"
    }  # resume state stays local by default
    got = _files(dest)
    assert set(got) == set(sent) | {".gitattributes"}
    for name, data in sent.items():
        assert got[name] == data, name
    head = hub.repos[repo_id].commits[hub.repos[repo_id].refs["main"]]
    weights = [p for p in head.files if p.endswith(".safetensors")]
    assert weights and all(head.files[p].is_lfs for p in weights)  # the weights went through the LFS upload


def test_from_pretrained_by_repo_id_loads_the_exact_weights(
    pushed: dict, client: Client, model, work: Path, hub: HubServer
) -> None:
    from safetensors.torch import load_file

    _ok(
        client.python(f"""
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM
        for repo_id, out in [("user/tiny", "fp-single.safetensors"),
                             ("user/tiny-sharded", "fp-sharded.safetensors")]:
            m = AutoModelForCausalLM.from_pretrained(repo_id)
            save_file({{k: v.contiguous() for k, v in m.state_dict().items()}}, {str(work)!r} + "/" + out)
    """)
    )
    # the sharded repo has no model.safetensors: transformers asked, got the Hub's EntryNotFound 404, moved on
    missing = [r for r in hub.requests if r[1].startswith("/user/tiny-sharded/resolve/") and r[3] == 404]
    assert any(r[1].endswith("/model.safetensors") for r in missing), missing
    expected = model.state_dict()
    for name in ("fp-single.safetensors", "fp-sharded.safetensors"):
        loaded = load_file(work / name)
        assert set(loaded) == set(expected), name
        for key, value in expected.items():
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), (name, key)


def test_push_to_a_new_branch_and_pull_that_revision(
    pushed: dict, client: Client, work: Path, hub: HubServer
) -> None:
    folder = pushed["user/tiny-sharded"]
    _ok(client.cli("push", str(folder), "user/tiny-sharded", "--revision", "run-2", "--include-resume-state"))
    repo = hub.repos["user/tiny-sharded"]
    assert "run-2" in repo.refs and repo.refs["run-2"] != repo.refs["main"]
    dest = work / "pulled-branch"
    _ok(client.cli("pull", "user/tiny-sharded", str(dest), "--revision", "run-2"))
    got = _files(dest)
    assert got["latest"] == b"global_step7" and "global_step7/checkpoint.json" in got
    assert not (work / "pulled-user_tiny-sharded" / "latest").exists()  # main has no resume state
    # pushing the same folder again changes nothing, and commits nothing
    before = len(repo.commits)
    _ok(client.cli("push", str(folder), "user/tiny-sharded", "--revision", "run-2", "--include-resume-state"))
    assert len(repo.commits) == before


def test_model_card_parses_and_records_how_the_model_was_trained(
    pushed: dict, work: Path, tmp_path: Path
) -> None:
    from huggingface_hub import ModelCard

    from hf_zero.hub.transfer import render_model_card

    card = ModelCard.load(pushed["user/tiny-sharded"] / "README.md")
    assert card.data.library_name == "transformers"  # the library that loads it; hf_zero is a tag
    assert {"transformers", "hf_zero", "zero-stage-3"} <= set(card.data.tags)
    assert card.data.base_model == "meta-llama/Tiny" and card.data.datasets == ["user/sentences"]
    assert card.data.pipeline_tag == "text-generation"
    assert (
        card.data.eval_results[0].metric_type == "accuracy" and card.data.eval_results[0].metric_value == 0.75
    )
    body = card.text
    assert "```json\n" + json.dumps(ZERO_CONFIG, indent=2) + "\n```" in body
    assert "2 x CPU (gloo)" in body and "1,234 tokens/s" in body
    assert 'AutoModelForCausalLM.from_pretrained("user/tiny-sharded")' in body
    # the card the CLI wrote (no details given) still parses and names the library
    plain = ModelCard.load(pushed["user/tiny"] / "README.md")
    assert plain.data.library_name == "transformers" and "Not recorded." in plain.text
    # a folder without config.json, metrics without a dataset: no model-index, metrics in the body
    (tmp_path / "model.safetensors").write_bytes(b"")
    text = render_model_card(tmp_path, metrics={"loss": 1.5}, extra={"license": "apache-2.0"})
    other = ModelCard(text)
    assert other.data.license == "apache-2.0" and other.data.eval_results is None and "| loss | 1.5 |" in text


def test_token_is_sent_and_never_leaked(pushed: dict, client: Client, work: Path, hub: HubServer) -> None:
    # The server answers API requests without the right token with 401, so every push and pull that
    # succeeded sent it; only the pre-signed LFS upload and the public agent registry go without.
    public = ("/lfs-upload/", "/api/agent-harnesses")
    api = [(ok, status) for method, path, ok, status in hub.requests if not path.startswith(public)]
    assert any(ok for ok, status in api) and all(ok or status == 401 for ok, status in api)
    token = hub.token
    for text in client.outputs:
        assert token not in text
    for path in work.rglob("*"):
        if path.is_file():
            assert token.encode() not in path.read_bytes(), path
    for repo in hub.repos.values():
        for commit in repo.commits.values():
            for entry in commit.files.values():
                assert token.encode() not in (entry.content or b"")
    assert all(token.encode() not in body for body in hub.bodies)


def test_wrong_token_is_refused_with_one_line(pushed: dict, client: Client, work: Path) -> None:
    proc = client.cli("pull", "user/tiny", str(work / "refused"), token="hf_wrong")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "hf-zero pull: error: the Hub rejected the token while trying to pull user/tiny "
        "(log in with `hf auth login` or set HF_TOKEN)."
    ]


def test_errors_are_one_sentence_and_exit_nonzero(pushed: dict, client: Client, work: Path) -> None:
    missing = work / "no-such-folder"
    proc = client.cli("push", str(missing), "user/tiny")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"hf-zero push: error: cannot push {missing}: the folder does not exist."
    ]

    empty = work / "empty-folder"
    empty.mkdir()
    proc = client.cli("push", str(empty), "user/tiny")
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1
    assert "has no model weights" in proc.stderr

    proc = client.cli("pull", "user/nope", str(work / "nope"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"hf-zero pull: error: repository user/nope was not found on {client.hub.url} "
        "(or the token in use cannot see it)."
    ]
    proc = client.cli("pull", "user/tiny", str(work / "nope"), "--revision", "no-branch")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "hf-zero pull: error: revision 'no-branch' was not found in repository user/tiny."
    ]


def test_unknown_endpoint_fails_the_test(pushed: dict, client: Client, hub: HubServer) -> None:
    """The guard itself: a call the server does not model is recorded (and would fail the test)."""
    proc = client.python("""
        from huggingface_hub import HfApi
        HfApi().list_repo_commits("user/tiny")
    """)
    assert proc.returncode != 0
    assert hub.unknown_calls == ["GET /api/models/user/tiny/commits/main"]
    hub.unknown_calls.clear()  # seen: this test expected it


def test_engine_push_pull_from_pretrained_and_resume(client: Client, work: Path) -> None:
    """engine.push_to_hub with the resume state; pull into an empty cache; from_pretrained by repo id and
    load_checkpoint from the pulled folder both give what the pushing engine had."""
    out = work / "engine_run"
    code = f"""
        import json, torch, hf_zero
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
        cfg = {{"train_micro_batch_size_per_gpu": 2, "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-2}}}},
                "zero_optimization": {{"stage": 2}}}}
        engine, _, _, _ = hf_zero.initialize(model=model, config=cfg)
        ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
        def step():
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss); engine.step()
            return loss.item()
        step(); step()
        engine.save_checkpoint({str(out)!r})
        print("URL", engine.push_to_hub("user/engine-run", {str(out)!r}, include_resume_state=True))
        after = [step(), step()]
        json.dump({{"after": after, "weights": {{n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()}}}},
                  open({str(work / "engine_ref.json")!r}, "w"))
    """
    _ok(client.python(code))
    pulled = work / "engine_pulled"
    _ok(client.cli("pull", "user/engine-run", str(pulled)))
    assert (pulled / "latest").read_text() == "global_step2" and (pulled / "README.md").exists()
    check = f"""
        import json, torch, hf_zero
        from transformers import AutoModelForCausalLM
        ref = json.load(open({str(work / "engine_ref.json")!r}))
        hub_model = AutoModelForCausalLM.from_pretrained("user/engine-run")
        local = AutoModelForCausalLM.from_pretrained({str(pulled)!r})
        same = all(torch.equal(a, b) for a, b in zip(hub_model.state_dict().values(), local.state_dict().values()))
        cfg = {{"train_micro_batch_size_per_gpu": 2, "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-2}}}},
                "zero_optimization": {{"stage": 2}}}}
        engine, _, _, _ = hf_zero.initialize(model=local, config=cfg)
        engine.load_checkpoint({str(pulled)!r})
        ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
        after = []
        for _ in range(2):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss); engine.step(); after.append(loss.item())
        weights = {{n: p.detach().reshape(-1).tolist() for n, p in local.named_parameters()}}
        print("RESULT", same, after == ref["after"], weights == ref["weights"])
    """
    res = _ok(client.python(check))
    assert "RESULT True True True" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]


def test_trainer_push_to_hub_uploads_consolidated_weights_and_card(client: Client, work: Path) -> None:
    """``hf_zero.Trainer(push_to_hub=True)`` on 2 processes under stage 3: the repo gets the consolidated
    weights (``from_pretrained`` by repo id equals what the engine holds), the tokenizer-free config and a
    model card tagged ``hf_zero``; checkpoints' resume state stays local."""
    out = work / "trainer_run"
    script = work / "trainer_push.py"
    script.write_text(textwrap.dedent(f"""
        import json, torch, hf_zero
        from datasets import Dataset
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
        ids = torch.randint(0, 128, (16, 8), generator=torch.Generator().manual_seed(1)).tolist()
        args = hf_zero.TrainingArguments(
            output_dir={str(out)!r}, per_device_train_batch_size=2, max_steps=3, learning_rate=1e-2,
            report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="steps", save_steps=2,
            push_to_hub=True, hub_model_id="user/trainer-run", hub_strategy="end",
            zero_config={{"zero_optimization": {{"stage": 3, "stage3_param_persistence_threshold": 40}},
                         "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}})
        trainer = hf_zero.Trainer(model=model, args=args, train_dataset=Dataset.from_dict({{"input_ids": ids, "labels": ids}}))
        trainer.train()
        trainer.push_to_hub(commit_message="end of zero run")
        state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
        if trainer.is_world_process_zero():
            json.dump({{k: v.float().reshape(-1).tolist() for k, v in state.items()}}, open({str(work / "trainer_ref.json")!r}, "w"))
    """))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _ok(client.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
                    str(script)]))
    check = f"""
        import json, torch
        from huggingface_hub import HfApi, ModelCard
        from transformers import AutoModelForCausalLM
        ref = json.load(open({str(work / "trainer_ref.json")!r}))
        files = sorted(HfApi().list_repo_files("user/trainer-run"))
        model = AutoModelForCausalLM.from_pretrained("user/trainer-run")
        same = all(p.detach().reshape(-1).tolist() == ref[n] for n, p in model.named_parameters())
        card = ModelCard.load("user/trainer-run")
        print("RESULT", same, json.dumps(files), json.dumps(card.data.tags))
    """
    res = _ok(client.python(check))
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT"))
    same, rest = line.split(" ", 2)[1:]
    files, tags = json.loads(rest[: rest.index("] [") + 1]), json.loads(rest[rest.index("] [") + 2:])
    assert same == "True", res.stdout[-2000:]
    assert "model.safetensors" in files and "config.json" in files and "README.md" in files, files
    assert not any(f.startswith("checkpoint-") or "zero_state" in f for f in files), files
    assert "hf_zero" in tags and "zero-stage-3" in tags, tags
