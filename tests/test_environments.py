"""Environments in the tool loop (issue 29): hostile environments, episode isolation, SFT/loop token equality,
environment-judged evaluation and rewards, prepare, and the config errors. The environments themselves (checker,
solver, generator) are tested in test_env_countdown.py / test_env_gridworld.py; parity with TRL's own loop in
test_env_parity.py."""

from __future__ import annotations

import contextlib
import json
import threading
from types import SimpleNamespace

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from agentrl.agent.loop import Rollout, generate_with_tools, sft_features, tokenize_trace
from agentrl.agent.tools import Call, split_annotated
from agentrl.data import messages
from agentrl.envs import countdown, gridworld
from conftest import make_toolset, mini_params, tiny_lm

HERE = __name__  # environments defined below are named "<this module>:Class", as agent.environment names them
RELEASE = threading.Event()  # lets a hung tool (or reset) return once the test is over


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's matrices are a few dozen wide: with the portable mode's 2 intra-op threads on a loaded
    2-core machine each matmul waits on the other thread (measured: 11 ms vs 0.03 ms per 32x64 linear)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
    RELEASE.set()


# ----------------------------------------------------------------------------------- environments under test
class Hostile:
    """One tool whose answer the argument picks: junk, an exception or a hang."""

    def reset(self, **row) -> None:
        return None

    def act(self, kind: str) -> str:
        """Do something.

        Args:
            kind: what to answer.
        """
        if kind == "none":
            return None
        if kind == "dict":
            return {"a": [1, 2], "b": None}
        if kind == "huge":
            return "x" * 1_000_000
        if kind == "markers":
            return "a>>b<<c"
        if kind == "raise":
            raise RuntimeError("boom")
        if kind == "hang":
            RELEASE.wait(30)
            return "late"
        return kind


class BadReset:
    def reset(self, **row) -> None:
        raise ValueError(f"bad row {row.get('id')}")

    def act(self, kind: str) -> str:
        """Do something.

        Args:
            kind: what to answer.
        """
        return kind


class HangingReset(BadReset):
    def reset(self, **row) -> None:
        RELEASE.wait(5)


class Tally:
    """A sloppy stateful environment: `reset` records the row but never clears the counter, so any instance shared
    between two completions (rows, samples or batches) shows up as a count that does not start at 1."""

    def __init__(self):
        self.n = 0
        self.who = None

    def reset(self, **row) -> None:
        self.who = row.get("id")

    def tick(self, note: str) -> str:
        """Count a call.

        Args:
            note: anything.
        """
        self.n += 1
        return f"{self.who}:{self.n}"


class Dealt:
    """`reset` deals each instance its own card (a counter stands in for a random draw) and says which: two samples
    of one prompt observe different things, as in TRL's loop, where each rollout's reset observation is its own."""

    dealt = 0

    def reset(self, **row) -> str:
        Dealt.dealt += 1
        self.card = Dealt.dealt
        return f" card {self.card}"

    def show(self, what: str) -> str:
        """Show the card.

        Args:
            what: anything.
        """
        return f"card {self.card}"


class Table(Dealt):
    """The same observation for every instance (a reset that reads only the row)."""

    def reset(self, **row) -> str:
        self.card = 7
        return " card 7"


# ----------------------------------------------------------------------------------- a tiny model, forced
@pytest.fixture(scope="module")
def tiny():
    from trl.chat_template_utils import qwen3_chat_template

    """(tokenizer, model, Qwen3's chat template): one tiny model for both formats (the chat tests swap the template
    in and back); a context long enough for the chat format's tool-described prompts."""
    texts = [r["question"] + r["answer"] for r in env_rows("countdown", 20, 0) + env_rows("gridworld", 20, 0)]
    tok, model = tiny_lm(texts * 3, 400, max_position_embeddings=2048)
    model.eval()
    return tok, model, qwen3_chat_template


def prompt_of(question: str) -> list[dict]:
    return messages("", question)


class Pieces(LogitsProcessor):
    """Inline format: the row whose prompt contains `scripts[i][0]` writes `scripts[i][1][k]` after its k-th tool
    result (`>>`), token by token as the tokenizer splits the piece, then eos after the last piece. Read from the
    row's own text, so rows are forced alike however the loop batches, pauses and resumes them."""

    def __init__(self, tok, scripts: list[tuple[str, list[str]]]):
        self.tok, self.scripts = tok, []
        for key, pieces in scripts:
            ids = [tok(p, add_special_tokens=False)["input_ids"] for p in pieces]
            self.scripts.append((key, [(i, [tok.decode(i[:j]) for j in range(len(i) + 1)]) for i in ids]))

    def __call__(self, input_ids, scores):
        for r in range(input_ids.shape[0]):
            text = self.tok.decode([t for t in input_ids[r].tolist() if t != self.tok.pad_token_id])
            prompt, _, comp = text.rpartition("<|im_start|>assistant\n")
            pieces = next(p for key, p in self.scripts if key in prompt)
            k, tail = comp.count(">>"), comp.rpartition(">>")[2]
            want = self.tok.eos_token_id
            if k < len(pieces):
                ids, prefixes = pieces[k]
                j = prefixes.index(tail) if tail in prefixes else len(ids)
                want = ids[j] if j < len(ids) else want
            scores[r, :] = -1e9
            scores[r, want] = 0
        return scores


def run_inline(tiny, toolset, scripts, rows=None, num_samples=1, budget=400, batch_size=8):
    tok, model, _ = tiny
    prompts = [prompt_of(q) for q, _ in scripts]
    lp = LogitsProcessorList([Pieces(tok, scripts)])
    out = generate_with_tools(
        model, tok, prompts, toolset, budget, batch_size=batch_size, num_samples=num_samples, rows=rows,
        logits_processor=lp,
    )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------- 2. robustness
def test_hostile_environment_never_stops_the_loop_and_each_failure_is_a_counted_result(tiny):
    ts = make_toolset(None, "inline", max_calls=8, environment=f"{HERE}:Hostile", timeout_s=0.5)
    kinds = ["none", "dict", "huge", "markers", "raise", "hang", "ok"]
    scripts = [
        ("Q hostile", [f"<<{k}=" for k in kinds] + ["\n#### 1"]),
        ("Q calm", ["<<fine=", "<<fine=", "\n#### 2"]),  # same batch: its episode is its own
    ]
    out = run_inline(tiny, ts, scripts, budget=600)
    hostile, calm = out[0][0], out[1][0]
    results = [c["result"] for c in hostile.calls]
    assert [c["arguments"] for c in hostile.calls] == [{"expression": k} for k in kinds]
    assert results[0] == "null"  # None: a JSON rendering, never the string 'None' pretending to be an answer
    assert json.loads(results[1]) == {"a": [1, 2], "b": None}
    assert results[2] == "x" * ts.max_result_chars  # 1 MB truncated before it reaches the tokenizer
    assert results[3] == "a> >b< <c"  # cannot close the call or open another one
    assert results[4] == "error: RuntimeError: boom"
    assert results[5].startswith("error: tool 'act' timed out (no answer within 0.5 s)")
    assert results[6].startswith("error: tool 'act' timed out")  # the episode's environment is abandoned
    assert [c["ok"] for c in hostile.calls] == [True, True, True, True, False, False, False]
    assert hostile.tool_errors == 3 and hostile.finish_reason == "stop" and hostile.text.endswith("#### 1")
    # the other row kept going, on its own environment (a fresh thread serves calls after the hang)
    assert [(c["result"], c["ok"]) for c in calm.calls] == [("fine", True)] * 2 and calm.text.endswith("#### 2")
    # the loop's tokens are what it reported: every result (sanitised) is in the completion, masked out
    tok = tiny[0]
    inserted = tok.decode([t for t, m in zip(hostile.completion_ids, hostile.env_mask) if m == 0])
    assert inserted == "".join(f"{r}>>" for r in results)


@pytest.mark.parametrize("cls", ["BadReset", "HangingReset"])
def test_environment_whose_reset_raises_or_hangs_gives_error_results(tiny, cls):
    ts = make_toolset(None, "inline", max_calls=4, environment=f"{HERE}:{cls}", timeout_s=0.5)
    scripts = [("Q one", ["<<a=", "<<b=", "\n#### 1"]), ("Q two", ["<<c=", "\n#### 2"])]
    out = run_inline(tiny, ts, scripts, rows=[{"id": "r1"}, {"id": "r2"}])
    want = "error: environment reset failed: " + (
        "ValueError: bad row" if cls == "BadReset" else "TimeoutError: no answer within 0.5 s"
    )
    for (r,), n in zip(out, (2, 1)):
        assert len(r.calls) == n and r.tool_errors == n and r.finish_reason == "stop"
        assert all(c["result"].startswith(want) and not c["ok"] for c in r.calls), r.calls


def test_episode_run_turns_every_bad_call_into_an_error_result():
    """The chat format's ways to call wrongly: unknown tool, malformed JSON, wrong argument, oversized argument."""
    ts = make_toolset(None, "chat", environment=f"{HERE}:Hostile", timeout_s=0.5)
    ep = ts.episode({})
    assert ep.run(Call("nope", {})) == ("error: unknown tool 'nope'; available: act", False)
    assert ts.format.open_call('<tool_call>\n{"name": "act", "arguments": [1]}\n</tool_call>', at_eos=True).name == (
        "<invalid>"
    )
    out, ok = ep.run(ts.format.open_call("<tool_call>\n{not json}\n</tool_call>", at_eos=True))
    assert not ok and out.startswith("error: invalid tool call")
    out, ok = ep.run(Call("act", {"kind": "x", "extra": 1}))
    assert not ok and out.startswith("error: TypeError") and "extra" in out
    out, ok = ep.run(Call("act", {"kind": "k" * 5000}))
    assert (out, ok) == (f"error: argument longer than {ts.max_expression_chars} characters", False)
    assert ep.run(Call("act", {"kind": "markers"})) == ("a>>b<<c", True)  # chat results need no inline escaping


# ----------------------------------------------------------------------------------- 3. episode isolation
def test_each_completion_and_each_row_gets_its_own_gridworld(tiny):
    """Two samples of one prompt and two prompts in one batch: the same forced moves in every completion; each
    sees exactly what a fresh environment of its own answers (a shared agent would be moved twice as far)."""
    ts = make_toolset(None, "inline", max_calls=8, environment="gridworld", env_kwargs={"slip_prob": 0.0})
    a = {"id": "a", "grid": ["S...", "....", "....", "...G"], "start": [0, 0], "goal": [3, 3], "seed": 1}
    b = {"id": "b", "grid": ["...S", "....", ".O..", "G..."], "start": [0, 3], "goal": [3, 0], "seed": 2}
    moves = {"a": ["right", "right", "down"], "b": ["down", "left", "left"]}
    scripts = [(gridworld.question(r["grid"]), [f"<<{m}=" for m in moves[r["id"]]] + ["\n#### goal"]) for r in (a, b)]
    out = run_inline(tiny, ts, scripts, rows=[a, b], num_samples=2)

    def solo(row):
        env = gridworld.GridWorld(slip_prob=0.0)
        env.reset(**row)
        return [env.move(m) for m in moves[row["id"]]]

    assert solo(a) == ["0 1", "0 2", "1 2"] and solo(b) == ["1 3", "1 2", "1 1"]
    for row, rolls in zip((a, b), out):
        assert len(rolls) == 2
        for roll in rolls:
            assert [c["result"] for c in roll.calls] == solo(row)
            assert roll.episode.env.position == [int(x) for x in solo(row)[-1].split()]
    envs = [roll.episode.env for rolls in out for roll in rolls]
    assert len({id(e) for e in envs}) == 4


def test_no_state_crosses_rows_samples_or_batches(tiny):
    ts = make_toolset(None, "inline", max_calls=4, environment=f"{HERE}:Tally")
    scripts = [("Q first", ["<<x=", "<<y=", "\n#### 1"]), ("Q second", ["<<z=", "\n#### 2"])]
    rows = [{"id": "A"}, {"id": "B"}]
    for _ in range(2):  # a second batch starts from fresh instances too
        out = run_inline(tiny, ts, scripts, rows=rows, num_samples=2)
        for rolls, (who, n) in zip(out, (("A", 2), ("B", 1))):
            for roll in rolls:
                assert [c["result"] for c in roll.calls] == [f"{who}:{i}" for i in range(1, n + 1)]


def test_each_sample_gets_its_own_reset_observation(tiny):
    """A reset observation goes into the prompt of the completion whose episode returned it (TRL appends each
    rollout's own); samples that observe alike share one prompt. The row hook still gets (prompt, sample)."""
    tok, model, _ = tiny
    seen = []

    def hook(i, s, ids):
        seen.append((i, s))
        return False

    for cls, shared in (("Dealt", False), ("Table", True)):
        ts = make_toolset(None, "inline", max_calls=2, environment=f"{HERE}:{cls}")
        scripts = [("Q first", ["<<a=", "\n#### 1"]), ("Q second", ["<<b=", "\n#### 2"])]
        prompts = [prompt_of(q) for q, _ in scripts]
        seen.clear()
        out = generate_with_tools(
            model, tok, prompts, ts, 60, batch_size=8, num_samples=3, row_hook=hook,
            logits_processor=LogitsProcessorList([Pieces(tok, scripts)]),
        )  # fmt: skip
        assert [len(rolls) for rolls in out] == [3, 3]
        for (q, _), rolls in zip(scripts, out):
            for roll in rolls:
                prompt = tok.decode(roll.prompt_ids)
                card = roll.episode.env.card
                assert q in prompt and prompt.endswith(f" card {card}<|im_end|>\n<|im_start|>assistant\n"), prompt
                assert roll.calls[0]["result"] == f"card {card}"  # the episode the prompt came from answers
            assert (len({r.episode.env.card for r in rolls}) == 1) == shared
        assert set(seen) == {(i, s) for i in range(2) for s in range(3)}


def _rollout_trainer(model, tok, temperature=1.0, completion_length=4):
    """What grpo.ToolRollout reads of a GRPOTrainer, for calling it outside one."""
    from types import SimpleNamespace

    from accelerate import Accelerator

    return SimpleNamespace(
        model_wrapped=model, accelerator=Accelerator(cpu=True), processing_class=tok,
        max_completion_length=completion_length, temperature=temperature, top_p=1.0, top_k=0, min_p=None,
        repetition_penalty=None,
        args=SimpleNamespace(ds3_gather_for_generation=True, gradient_checkpointing_kwargs=None),
    )  # fmt: skip


def test_tool_rollout_renders_the_chat_prompt_with_its_tools(tiny):
    """grpo.ToolRollout (our loop as TRL's rollout_func) renders a chat-format prompt with the environment's tool
    description, as evaluation and SFT do (toolset.chat_template_kwargs): the prompt ids GRPO trains on are the ones
    the policy is evaluated with."""
    from agentrl.stages.grpo import ToolRollout

    tok, model, qwen3 = tiny
    saved = tok.chat_template
    tok.chat_template = qwen3
    try:
        ts = make_toolset(None, "chat", max_calls=2, environment="countdown", eos_token=tok.eos_token)
        row = env_rows("countdown", 1, seed=2)[0]
        prompt = prompt_of(row["question"])
        rollout = ToolRollout(ts)
        rollout.batch_rows = [{**row, "prompt": prompt}]
        out = rollout([prompt], _rollout_trainer(model, tok, 1.0, 4))
        want = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False, **ts.chat_template_kwargs())
        assert "check" in want and out["prompt_ids"][0] == tok(want, add_special_tokens=False)["input_ids"]
    finally:
        tok.chat_template = saved


class ResetFailsOnOddRows:
    """An environment whose reset fails for odd `n` (a dead server, a row the environment cannot load)."""

    def reset(self, **row):
        if row.get("n", 0) % 2:
            raise ConnectionError("server gone")

    def check(self, expression: str) -> str:
        """Check an expression.

        Args:
            expression: the expression.
        """
        return "ok"


def test_grpo_rollouts_count_broken_episodes_and_stop_past_the_share(tiny):
    """Issue 56 item 1: GRPO trained on, scoring episodes whose environment failed as wrong answers. ToolRollout
    logs tools/broken_episode_rate, and once the stage's broken episodes pass agent.max_broken_share it raises
    BrokenEnvironmentError naming the first failure (grpo exits non-zero with that line)."""
    from agentrl.agent.loop import BrokenEnvironmentError
    from agentrl.stages.grpo import ToolRollout

    tok, model, _ = tiny
    ts = make_toolset(
        None, "inline", max_calls=2, environment="countdown", env_class=ResetFailsOnOddRows, eos_token=tok.eos_token
    )
    prompt = prompt_of("What is 2+2?")
    rows = [{"prompt": prompt, "n": n} for n in (0, 2, 4, 1)]
    trainer = _rollout_trainer(model, tok, 1.0, 4)
    lenient = ToolRollout(ts, max_broken_share=0.3)
    lenient.batch_rows = rows
    lenient([prompt] * 4, trainer)  # 1 of 4 broken: within the share
    assert lenient.broken == 1 and lenient.pop_curves()["tools/broken_episode_rate"] == 0.25
    strict = ToolRollout(ts, max_broken_share=0.2)
    strict.batch_rows = rows
    with pytest.raises(BrokenEnvironmentError, match=r"grpo: 1 of 4 episodes .*first: environment reset failed: "
                       r"ConnectionError: server gone.*max_broken_share=0.2"):  # fmt: skip
        strict([prompt] * 4, trainer)


class LosesItsServer:
    """An environment whose server goes away: every tool call after `lost` is set raises EnvironmentLost."""

    lost = False

    def reset(self, **row):
        return None

    def check(self, expression: str) -> str:
        """Check an expression.

        Args:
            expression: the expression.
        """
        from agentrl.envs.contract import EnvironmentLost

        if LosesItsServer.lost:
            raise EnvironmentLost("http://127.0.0.1:9/ closed the session")
        return "ok"


def test_trl_loop_episodes_whose_server_is_gone_are_counted_as_broken(monkeypatch):
    """Issue 56 item 1 in TRL's own loop (agent.format chat): TRL counted a tool call that raised as the policy's
    failed call and went on. Through BrokenEpisodes.track, an episode whose tool raised EnvironmentLost is broken
    (once, however many calls failed), logged as tools/broken_episode_rate and checked against the share; the
    tools TRL renders (names, signatures, docstrings) are the environment's own."""
    import functools

    from transformers.utils import get_json_schema

    from agentrl.agent.loop import BrokenEnvironmentError, BrokenEpisodes
    from agentrl.envs.contract import EnvironmentLost

    monkeypatch.setattr(LosesItsServer, "lost", False)
    ledger = BrokenEpisodes(max_share=0.3)
    factories = ledger.track({"a": functools.partial(LosesItsServer), "b": LosesItsServer})
    env = factories["a"]()
    assert isinstance(env, LosesItsServer) and get_json_schema(env.check) == get_json_schema(LosesItsServer().check)
    for _ in range(3):  # three healthy episodes
        env.reset(n=1)
        assert env.check("1+1") == "ok"
    ledger.check()
    LosesItsServer.lost = True
    env.reset(n=2)
    for _ in range(2):  # the fourth episode loses its server: two failed calls, one broken episode
        with pytest.raises(EnvironmentLost):
            env.check("1+1")
    assert (ledger.episodes, ledger.broken) == (4, 1) and ledger.first.startswith("check: http://127.0.0.1:9/")
    assert ledger.pop_curves() == {"tools/broken_episode_rate": 0.25} and ledger.pop_curves() == {}
    ledger.check()  # 1 of 4 is within 0.3
    other = factories["b"]()
    other.reset(n=3)
    with pytest.raises(EnvironmentLost):
        other.check("2")
    with pytest.raises(BrokenEnvironmentError, match=r"grpo: 2 of 5 episodes had a broken environment .*first: check"):
        ledger.check()


class ClosesItsSession:
    """An environment with the optional close(): counts the episodes it ended."""

    closed = 0

    def reset(self, **row):
        return None

    def check(self, expression: str) -> str:
        """Check an expression.

        Args:
            expression: the expression.
        """
        return "ok"

    def close(self) -> None:
        ClosesItsSession.closed += 1


def test_each_episode_is_closed_once_judged_and_close_is_never_a_tool(tiny, monkeypatch):
    """Issue 55 item 3: the contract had no teardown, so a wrapper's sessions stayed open until garbage collection
    (384 abnormal disconnects over two short runs). The optional close() is called once per episode after it is
    judged (our loop), by close_all after training (TRL's loop, which pools its instances), and it is offered to
    no policy: not by our loop, not by TRL (the class TRL gets hides a plain close)."""
    import inspect

    from agentrl.agent.loop import BrokenEpisodes
    from agentrl.envs.contract import environment_tools
    from agentrl.stages.grpo import ToolRollout

    monkeypatch.setattr(ClosesItsSession, "closed", 0)
    tok, model, _ = tiny
    ts = make_toolset(
        None, "inline", max_calls=2, environment="countdown", env_class=ClosesItsSession, eos_token=tok.eos_token
    )
    assert list(ts.tools) == ["check"] and "close" not in environment_tools(ClosesItsSession())
    prompt = prompt_of("What is 2+2?")
    rollout = ToolRollout(ts)
    rollout.batch_rows = [{"prompt": prompt, "n": n} for n in range(4)]
    rollout([prompt] * 4, _rollout_trainer(model, tok, 1.0, 4))
    assert ClosesItsSession.closed == 4
    ledger = BrokenEpisodes(max_share=0.0)
    for_trl = ledger.track(ClosesItsSession)
    functions = inspect.getmembers(for_trl, predicate=inspect.isfunction)
    offered = [name for name, _ in functions if name not in ("reset", "get_reward") and not name.startswith("_")]
    assert offered == ["check"], offered  # TRL 1.16 offers every public function but reset/get_reward
    envs = [for_trl() for _ in range(3)]
    for env in envs:
        env.reset(n=1)
    ledger.close_all()
    assert ClosesItsSession.closed == 4 + 3


def test_tool_rollout_resets_each_episode_with_its_batch_row_and_refuses_to_run_without_it(monkeypatch):
    """Rows that share a prompt (FrozenLake with a hidden map: every prompt is the same) are told apart only by the
    batch the stage's trainer hands over (ToolRollout.batch_rows): each episode gets its own row, in order. Episodes
    without their rows are refused, naming why; rows of other prompts too."""
    import random

    from agentrl.agent import loop
    from agentrl.envs import gymnasium_toytext as gt
    from agentrl.stages.grpo import ToolRollout

    rows = gt.make_rows(3, random.Random(0), "train", {"look": True}, map_size=4, show_map=False)
    rows = [{**r, "prompt": prompt_of(r["question"])} for r in rows]
    assert len({json.dumps(r["prompt"]) for r in rows}) == 1 and len({r["seed"] for r in rows}) == 3
    seen = []

    def fake_generate(model, tok, prompts, toolset, *args, rows=None, **kwargs):
        seen.append(rows)
        return []

    monkeypatch.setattr(loop, "generate_with_tools", fake_generate)
    rollout = ToolRollout(None)
    trainer = SimpleNamespace(
        model_wrapped=None, accelerator=None, processing_class=None, max_completion_length=4, temperature=1.0,
        top_p=1.0, top_k=0, min_p=None, repetition_penalty=None,
        args=SimpleNamespace(ds3_gather_for_generation=True, gradient_checkpointing_kwargs=None),
    )  # fmt: skip
    monkeypatch.setattr("trl.models.unwrap_model_for_generation", lambda model, *a, **k: contextlib.nullcontext())
    rollout.batch_rows = rows[::-1]
    rollout([r["prompt"] for r in rows[::-1]], trainer)
    assert [r["seed"] for r in seen[-1]] == [r["seed"] for r in rows[::-1]] and rollout.batch_rows is None
    with pytest.raises(RuntimeError, match="only the stage's trainer hands over"):
        ToolRollout(object())([rows[0]["prompt"]], trainer)
    rollout.batch_rows = rows[:1]
    with pytest.raises(RuntimeError, match="not the prompts"):
        rollout([{"role": "user", "content": "another"}], trainer)


def test_merged_policy_is_the_adapter_merged_and_follows_its_training(tiny):
    """grpo.merged_policy (grpo.merged_rollouts): the plain copy's logits are the PEFT model's (not the base
    model's); it computes on its own weights (a change to the adapter does not reach it until a refresh, also with
    TRL's fused LM head patched onto the model as GRPOTrainer does, whose forward closes over the original's); after
    the adapter changes (a training step) a refresh follows it, while the PEFT model's frozen base weights keep their
    exact bytes (no merge/unmerge round trip)."""
    import copy

    from peft import LoraConfig, get_peft_model
    from trl.trainer.utils import add_fused_lm_head

    from agentrl.stages.grpo import merged_policy

    tok, model, _ = tiny
    patched = copy.deepcopy(model)
    add_fused_lm_head(patched)  # as GRPOTrainer does before it wraps the model with PEFT
    assert "forward" in patched.__dict__
    peft = get_peft_model(patched, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    base = {n: p.detach().clone() for n, p in peft.named_parameters() if "lora_" not in n}
    torch.manual_seed(0)
    for n, p in peft.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.2)
    x = torch.tensor([tok("12 3 4 target 9", add_special_tokens=False)["input_ids"]])
    peft.eval()
    with torch.no_grad():
        plain = merged_policy(peft)
        want, got, bare = peft(x).logits, plain(x).logits, model(x).logits
        assert not hasattr(plain, "peft_config") and (want - bare).abs().max() > 1e-2  # the adapter matters here
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.mul_(-1.5)
        assert torch.equal(plain(x).logits, got)  # its own weights: the adapter's change waits for the refresh
        again = merged_policy(peft, plain)
        assert again is plain
        torch.testing.assert_close(plain(x).logits, peft(x).logits, atol=1e-4, rtol=1e-4)
        assert (plain(x).logits - got).abs().max() > 1e-2
    assert all(torch.equal(p, base[n]) for n, p in peft.named_parameters() if "lora_" not in n)


def _adapted_countdown(tiny):
    """(tokenizer, base model, PEFT model whose LoRA B matrices are drawn (the adapter changes what is sampled),
    countdown toolset, sample(rollout, model) -> the rollout's output for 4 countdown rows with seed 7)."""
    import copy

    from peft import LoraConfig, get_peft_model

    tok, model, _ = tiny
    peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    torch.manual_seed(1)
    for n, p in peft.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.2)
    ts = make_toolset(None, "inline", max_calls=3, environment="countdown", eos_token=tok.eos_token)
    rows = env_rows("countdown", 4, seed=5)
    prompts = [prompt_of(r["question"]) for r in rows]
    rows = [{**r, "prompt": p} for r, p in zip(rows, prompts)]

    def sample(rollout, m):
        torch.manual_seed(7)
        rollout.batch_rows = rows
        return rollout(prompts, _rollout_trainer(m, tok, 1.0, 24))

    return tok, model, peft, ts, sample


def test_merged_rollouts_sample_what_the_adapter_samples(tiny):
    """ToolRollout(merged=True) generates from the merged copy: countdown episodes sampled with the same seed have
    the PEFT model's completion ids and env_mask, which are not the base model's (the adapter changes what is
    sampled)."""
    from agentrl.stages.grpo import ToolRollout

    tok, model, peft, ts, sample = _adapted_countdown(tiny)
    adapter, bare = sample(ToolRollout(ts), peft), sample(ToolRollout(ts), model)
    merged = ToolRollout(ts, merged=True)
    out = sample(merged, peft)
    assert merged.plain is not None and not hasattr(merged.plain, "peft_config")
    assert out["completion_ids"] == adapter["completion_ids"] != bare["completion_ids"]
    assert out["env_mask"] == adapter["env_mask"]


def test_onednn_rollouts_sample_what_the_adapter_samples_and_follow_its_training(tiny):
    """grpo.rollout_linear_kernels onednn: ToolRollout packs the merged copy's Linear layers once (rollout_plan
    hands it the knob) and the countdown episodes it samples with a seed are the PEFT model's; after the adapter
    changes (a training step), the next rollout's copy computes the new weights (merged_policy repacks them)."""
    from agentrl.agent.linear_kernels import OneDNNLinear
    from agentrl.config import validate_params
    from agentrl.stages.grpo import ToolRollout, rollout_plan

    tok, _, peft, ts, sample = _adapted_countdown(tiny)
    p = mini_params()
    p["grpo"].update(merged_rollouts=True, rollout_linear_kernels="onednn")
    packed = rollout_plan(validate_params(p), SimpleNamespace(use_vllm=False), tok)[0]
    packed.toolset = ts
    assert (packed.merged, packed.kernels) == (True, "onednn")
    for _ in range(2):  # the first rollout packs the copy, the second repacks what changed
        adapter, out = sample(ToolRollout(ts), peft), sample(packed, peft)
        assert out["completion_ids"] == adapter["completion_ids"] and out["env_mask"] == adapter["env_mask"]
        assert any(isinstance(m, OneDNNLinear) for m in packed.plain.modules())
        x = torch.tensor([out["prompt_ids"][0] + out["completion_ids"][0]])
        with torch.no_grad():
            torch.testing.assert_close(packed.plain(x).logits, peft(x).logits, atol=1e-4, rtol=1e-4)
            for n, param in peft.named_parameters():  # a training step
                if "lora_B" in n:
                    param.mul_(-1.5)


@pytest.mark.parametrize(
    "extra, stale",
    [({"use_dora": True}, "lora_magnitude_vector"), ({"modules_to_save": ["lm_head"]}, "modules_to_save")],
)
def test_merged_policy_refuses_what_its_refresh_would_leave_stale(tiny, extra, stale):
    """The refresh recomputes base + B A: a LoRA that also trains other parameters (DoRA's magnitudes, a
    modules_to_save copy) is refused by name instead of generating from stale weights."""
    import copy

    from peft import LoraConfig, get_peft_model

    from agentrl.stages.grpo import GRPOSettingsError, merged_policy

    _, model, _ = tiny
    peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **extra))
    with pytest.raises(GRPOSettingsError, match=f"merged_rollouts.*{stale}.*merged_rollouts: false"):
        merged_policy(peft)


@pytest.mark.parametrize(
    "fsdp, deepspeed, stage, refused",
    [(False, False, None, False), (False, True, 2, False), (False, True, 3, True), (True, False, None, True)],
)
def test_merged_rollouts_are_refused_with_sharded_weights(fsdp, deepspeed, stage, refused):
    """A whole-model copy per process cannot be made from ZeRO-3 or FSDP shards: grpo.check_merged_rollouts refuses
    it before the first step; DDP and ZeRO-2 (whole weights on every process) run, and so does merged_rollouts off."""
    from types import SimpleNamespace

    from agentrl.stages.grpo import GRPOSettingsError, ToolRollout, check_merged_rollouts

    plugin = SimpleNamespace(zero_stage=stage) if deepspeed else None
    trainer = SimpleNamespace(
        is_fsdp_enabled=fsdp,
        is_deepspeed_enabled=deepspeed,
        accelerator=SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin)),
        model=torch.nn.Linear(2, 2),
    )
    check_merged_rollouts(trainer, ToolRollout(None))  # off: nothing to refuse
    if refused:
        with pytest.raises(GRPOSettingsError, match="merged_rollouts.*ZeRO-3, FSDP"):
            check_merged_rollouts(trainer, ToolRollout(None, merged=True))
    else:
        check_merged_rollouts(trainer, ToolRollout(None, merged=True))


@pytest.mark.parametrize("dtype, refused", [(torch.float32, False), (torch.bfloat16, True)])
def test_onednn_rollouts_are_refused_before_the_first_step_where_they_cannot_run(dtype, refused):
    """grpo.rollout_linear_kernels onednn packs fp32 weights on the CPU: a bf16 (or GPU) policy is refused by
    check_merged_rollouts, before the first step, instead of failing at the first rollout."""
    from agentrl.stages.grpo import GRPOSettingsError, ToolRollout, check_merged_rollouts

    trainer = SimpleNamespace(
        is_fsdp_enabled=False, is_deepspeed_enabled=False, model=torch.nn.Linear(2, 2).to(dtype),
        accelerator=SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=None)),
    )  # fmt: skip
    check_merged_rollouts(trainer, ToolRollout(None, merged=True))  # aten: any dtype
    if refused:
        with pytest.raises(
            GRPOSettingsError, match="rollout_linear_kernels: onednn runs fp32 .* torch.bfloat16 on cpu"
        ):
            check_merged_rollouts(trainer, ToolRollout(None, merged=True, kernels="onednn"))
    else:
        check_merged_rollouts(trainer, ToolRollout(None, merged=True, kernels="onednn"))


def test_merged_rollouts_are_refused_where_they_would_not_run():
    """grpo.merged_rollouts needs a LoRA, and the project's loop: TRL's own loop (agent.format chat with an
    environment) and vLLM generate without it, so the knob is refused there rather than ignored."""
    from types import SimpleNamespace

    from agentrl.config import ParamsError, validate_params
    from agentrl.stages.grpo import GRPOSettingsError, ToolRollout, rollout_plan
    from conftest import raw_params

    p = raw_params()
    p["grpo"].update(use_lora=False, merged_rollouts=True)
    with pytest.raises(ParamsError, match="merged_rollouts.*use_lora"):
        validate_params(p)
    tok = SimpleNamespace(eos_token="<|im_end|>")
    p = raw_params()
    p["grpo"]["merged_rollouts"] = True
    p["agent"].update(tools=[], environment="countdown", format="chat")
    with pytest.raises(GRPOSettingsError, match="merged_rollouts.*TRL's own loop"):
        rollout_plan(validate_params(p), SimpleNamespace(use_vllm=False), tok)
    p["agent"].update(environment=None, format="inline")
    with pytest.raises(GRPOSettingsError, match="merged_rollouts.*vLLM"):
        rollout_plan(validate_params(p), SimpleNamespace(use_vllm=True), tok)
    rollout, factory = rollout_plan(validate_params(p), SimpleNamespace(use_vllm=False), tok)
    assert isinstance(rollout, ToolRollout) and rollout.merged and factory is None


# ----------------------------------------------------------------------------------- 4. integration
class Ids(LogitsProcessor):
    """Forces each row to write `expected[k]` (prompt k identified by its ids); tool tokens come from the loop, so any
    difference between what the environment answers in the loop and in the SFT features shifts the script."""

    def __init__(self, tok, traces: list[dict]):
        self.tok, self.traces = tok, traces

    def __call__(self, input_ids, scores):
        for r in range(input_ids.shape[0]):
            row = [t for t in input_ids[r].tolist() if t != self.tok.pad_token_id]
            t = next(t for t in self.traces if row[: len(t["prompt_ids"])] == t["prompt_ids"])
            pos = len(row) - len(t["prompt_ids"])
            want = t["completion_ids"][pos] if pos < len(t["completion_ids"]) else self.tok.eos_token_id
            scores[r, :] = -1e9
            scores[r, want] = 0
        return scores


def env_rows(name: str, n: int, seed: int) -> list[dict]:
    import random

    rows = {"countdown": countdown, "gridworld": gridworld}[name].make_rows(n, random.Random(seed), "train")
    return [{**r, "id": f"{name}-{i}"} for i, r in enumerate(rows)]


@pytest.mark.parametrize("name,fmt", [("countdown", "inline"), ("gridworld", "inline"), ("countdown", "chat")])
def test_sft_features_equal_the_loop_tokens_for_the_same_demo(tiny, name, fmt):
    """A demonstration replayed through the environment for SFT (agent.sft_features) is token for token what the loop
    produces when the policy writes the demo's own text: same ids, and the environment's answers masked."""
    tok, model, qwen3 = tiny
    saved = tok.chat_template
    if fmt == "chat":
        tok.chat_template = qwen3
    try:
        ts = make_toolset(None, fmt, max_calls=12, environment=name, eos_token=tok.eos_token)
        rows = env_rows(name, 3, seed=5)
        if name == "countdown":
            assert any(r["demo_failed_tries"] for r in rows)  # a demo with a failed try, then the fix
        prompts = [prompt_of(r["question"]) for r in rows]
        feats = [sft_features(tok, p, r["answer"], ts, r) for p, r in zip(prompts, rows)]
        kw = ts.chat_template_kwargs()
        traces = []
        for p, r in zip(prompts, rows):
            segs = split_annotated(r["answer"], fmt, tok.eos_token, ts.episode(r))
            traces.append(tokenize_trace(tok, p, segs, chat_template_kwargs=kw))
        lp = LogitsProcessorList([Ids(tok, traces)])
        out = generate_with_tools(
            model, tok, prompts, ts, 600, batch_size=8, rows=rows, chat_template_kwargs=kw, logits_processor=lp
        )
        for f, t, (roll,), r in zip(feats, traces, out, rows):
            assert roll.prompt_ids == t["prompt_ids"]
            assert roll.completion_ids == t["completion_ids"] and roll.env_mask == t["env_mask"]
            assert f["input_ids"] == roll.prompt_ids + roll.completion_ids
            assert f["tool_calls"] == len(roll.calls)  # counted against the demo two lines down
            assert f["completion_mask"] == [0] * len(roll.prompt_ids) + roll.env_mask
            assert roll.finish_reason == "stop" and len(roll.calls) == r["answer"].count("<<")
            assert all(c["ok"] for c in roll.calls)
            assert 0 in roll.env_mask
            # the demo's annotated results are what the environment answers (the loop ran the same episode)
            assert [c["result"] for c in roll.calls] == [a.split("=", 1)[1] for a in _annotations(r["answer"])]
    finally:
        tok.chat_template = saved


def _annotations(answer: str) -> list[str]:
    import re

    return re.findall(r"<<([^<>]*)>>", answer)


def _rollout(ts, row: dict, calls: list[str], text: str) -> Rollout:
    """A finished rollout whose episode ran `calls` through the environment (no model needed to score)."""
    ep = ts.episode(row)
    roll = Rollout(prompt_ids=[], text=text, finish_reason="stop", episode=ep)
    for arg in calls:
        result, ok = ep.run(Call("", {"expression": arg}))
        roll.calls.append({"name": ts.default_tool, "arguments": {"expression": arg}, "result": result, "ok": ok})
    return roll


def test_score_judges_countdown_by_its_checker_and_reports_recovery():
    from agentrl.stages.evaluate import score

    ts = make_toolset(None, "inline", environment="countdown")
    row = {"id": "c", "question": "q", "numbers": [3, 5, 3], "target": 24, "ground_truth": "24"}
    cases = [  # (calls, completion text, solved)
        (["3*5+3", "(3+5)*3"], "<<...>>\n#### (3+5)*3", True),  # recovered from a failed try
        (["(3+5)*3"], "#### (3+5)*3", True),  # first try
        (["(3+5)*3"], "#### 24", False),  # the target's number is not a legal expression
        (["3*5+3"], "#### 3*5+3", False),  # legal, off target
        ([], "#### (5+3)*3 ", True),  # no call needed: the answer line decides
    ]
    rows = [{**row, "id": f"c{i}"} for i in range(len(cases))]
    rollouts = [[_rollout(ts, r, calls, text)] for r, (calls, text, _) in zip(rows, cases)]
    samples = [[(text, 5)] for _, text, _ in cases]
    m, preds = score(rows, samples, {"accuracy": 1.0, "format": 0.5}, mini_params()["grpo"]["reward_kwargs"], rollouts)
    assert [p["correct"] for p in preds] == [c[2] for c in cases]
    assert m["accuracy"] == 3 / 5
    assert [p["reward"] for p in preds] == [1.5, 1.5, 0.5, 0.5, 1.5]  # accuracy from the checker, format: a #### line
    assert [p["failed_tries"] for p in preds] == [1, 0, 0, 1, 0]
    assert m["recovered_share"] == round(1 / 3, 4)  # 1 of the 3 solved episodes recovered from a failed try
    assert m["mean_turns"] == 1.0 and m["failed_tries_per_episode"] == 0.4
    assert preds[0]["extracted"] == "(3+5)*3"


def test_majority_vote_of_environment_episodes_uses_their_judgement():
    """With several samples per problem, the vote is over the final answers, each judged as the environment judged
    the samples that gave it (not the answer text against ground_truth: a countdown expression never equals the
    target's number)."""
    from agentrl.stages.evaluate import score

    ts = make_toolset(None, "inline", environment="countdown")
    row = {"id": "c", "question": "q", "numbers": [3, 5, 3], "target": 24, "ground_truth": "24"}
    per_row = [  # samples' final answers: majority right / majority wrong but one right
        ["#### (3+5)*3", "#### 3*5+3", "#### (3+5)*3"],
        ["#### 3*5+3", "#### 3*5+3", "#### (3+5)*3"],
    ]
    rows = [{**row, "id": f"c{i}"} for i in range(len(per_row))]
    rollouts = [[_rollout(ts, r, [], t) for t in texts] for r, texts in zip(rows, per_row)]
    m, _ = score(rows, [[(t, 3) for t in texts] for texts in per_row], {"accuracy": 1.0}, {}, rollouts)
    assert m["pass@3"] == 1.0 and m["majority_vote_accuracy"] == 0.5
    grid = make_toolset(None, "inline", environment="gridworld", env_kwargs={"slip_prob": 0.0})
    base = {"question": "q", "grid": ["S.", ".G"], "start": [0, 0], "goal": [1, 1], "seed": 0, "ground_truth": "goal"}
    played = [  # every sample claims the goal; in the second row one of them is not there
        [(["right", "down"], "#### goal"), (["down", "right"], "#### goal")],
        [(["right", "down"], "#### goal"), (["right"], "#### goal")],
    ]
    rows = [{**base, "id": f"g{i}"} for i in range(len(played))]
    rollouts = [[_rollout(grid, r, calls, t) for calls, t in samples] for r, samples in zip(rows, played)]
    m, _ = score(rows, [[(t, 3) for _, t in samples] for samples in played], {"accuracy": 1.0}, {}, rollouts)
    assert m["pass@2"] == 1.0 and m["majority_vote_accuracy"] == 0.5


def test_score_judges_gridworld_by_the_environment_not_the_text():
    from agentrl.stages.evaluate import score

    ts = make_toolset(None, "inline", environment="gridworld", env_kwargs={"slip_prob": 0.0})
    base = {"question": "q", "grid": ["S.", ".G"], "start": [0, 0], "goal": [1, 1], "seed": 0, "ground_truth": "goal"}
    cases = [
        (["right", "down"], "#### fail", True),  # reached the goal: solved whatever the text says
        (["right"], "#### goal", False),  # claims the goal, is not there
        (["up", "right", "down"], "#### goal", True),  # bumped a wall, then recovered
    ]
    rows = [{**base, "id": f"g{i}"} for i in range(len(cases))]
    rollouts = [[_rollout(ts, r, calls, text)] for r, (calls, text, _) in zip(rows, cases)]
    m, preds = score(rows, [[(t, 3)] for _, t, _ in cases], {"accuracy": 1.0}, {}, rollouts)
    assert [p["correct"] for p in preds] == [True, False, True]
    assert [p["reward"] for p in preds] == [1.0, 0.0, 1.0]
    assert m["recovered_share"] == 0.5 and m["mean_turns"] == 2.0
    assert preds[2]["tool_calls"][0] == {"expression": "up", "result": "0 0 wall", "ok": True}


def test_rewards_read_solved_flags_and_trl_environments():
    from agentrl.agent import rewards

    comps = ["#### (3+5)*3", "#### 24", "no answer line"]
    assert rewards.accuracy(comps, ["24"] * 3, solved=[True, False, None]) == [1.0, 0.0, 0.0]
    assert rewards.accuracy(["#### 24"], ["24"], solved=[None]) == [1.0]  # None: the ground truth decides
    assert rewards.format_reward(comps, solved=[True, False, False]) == [1.0, 1.0, 0.0]
    # TRL's GRPOTrainer(environment_factory=...): `environments` + the dataset columns (the rows reset() saw); the
    # completions are its tool loop's messages (assistant, tool, ..., assistant)
    envs = [countdown.Countdown(), countdown.Countdown(), countdown.Countdown()]
    cols = {"numbers": [[3, 5, 3]] * 3, "target": [24] * 3, "ground_truth": ["24"] * 3}
    for e in envs:
        e.reset(numbers=[3, 5, 3], target=24)
    trl_comps = [
        [
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "check"}}]},
            {"role": "tool", "name": "check", "content": "24 yes"},
            {"role": "assistant", "content": "#### (3+5)*3"},
        ],
        [{"role": "assistant", "content": "#### 24"}],
        [{"role": "assistant", "content": "#### 3*5+3"}],
    ]
    assert rewards.env_solved(trl_comps, environments=envs, **cols) == [True, False, False]
    assert rewards.accuracy(trl_comps, environments=envs, **cols) == [1.0, 0.0, 0.0]
    assert rewards.format_reward(trl_comps, environments=envs, **cols) == [1.0, 1.0, 1.0]
    grid = gridworld.GridWorld(slip_prob=0.0)
    grid.reset(grid=["SG"], start=[0, 0], goal=[0, 1], seed=0)
    assert rewards.accuracy([[{"role": "assistant", "content": "#### ?"}]], ["goal"], environments=[grid]) == [0.0]
    grid.move("right")
    assert rewards.accuracy([[{"role": "assistant", "content": "#### ?"}]], ["goal"], environments=[grid]) == [1.0]


def test_prepare_countdown_writes_rows_that_reset_the_environment(workdir):
    from agentrl.config import validate_params
    from agentrl.data import load_jsonl
    from agentrl.stages import prepare

    p = mini_params()
    p["agent"].update(tools=[], environment="countdown")
    p["environments"]["countdown"].update(num_train=20, num_test=5)
    m = prepare.prepare(validate_params(p))
    sft, rl, test = (load_jsonl(f"data/prepared/{s}.jsonl") for s in ("sft_train", "rl_train", "test"))
    assert m["written"] == {"sft_train": 20, "rl_train": 20, "test": 5} and m["source"] == "environment:countdown"
    assert {countdown.instance_key(r) for r in test}.isdisjoint(countdown.instance_key(r) for r in sft)
    ts = make_toolset(None, "inline", environment="countdown")
    for r in sft + rl + test:
        ep = ts.episode(r)  # the row's env fields reset the environment (no error, no broken episode)
        assert ep.broken is None and ep.env._numbers == r["numbers"] and ep.env._target == r["target"]
        assert r["prompt"][-1]["content"].startswith(f"Make {r['target']} from ")
    for r in sft:  # the demo's results are what a fresh episode of this row answers, and it ends solved
        ep = ts.episode(r)
        demo = r["completion"][0]["content"]
        for a in _annotations(demo):
            expr, _, result = a.partition("=")
            assert ep.run(Call("", {"expression": expr})) == (result, True)
        assert countdown.correct(r, demo, ep.env)
    assert all(r["ground_truth"] == str(r["target"]) for r in rl + test)
    assert m["demo_failed_try_share"] > 0
    assert "test_ceiling" not in m  # countdown's solver solves every instance


def test_prepare_gridworld_reports_the_test_ceiling(workdir):
    from agentrl.config import validate_params
    from agentrl.data import load_jsonl
    from agentrl.stages import prepare

    p = mini_params()
    p["agent"].update(tools=[], environment="gridworld")
    p["environments"]["gridworld"].update(num_train=20, num_test=8, slip_prob=0.3, max_moves=10)
    m = prepare.prepare(validate_params(p))
    test = load_jsonl("data/prepared/test.jsonl")
    assert m["test_ceiling"] == gridworld.ceiling(test, {"slip_prob": 0.3, "max_moves": 10})
    assert m["test_ceiling"] != gridworld.ceiling(test, {})  # the knobs reach it

    p["environments"]["gridworld"]["demo_explore"] = 0.5  # the teacher's knob reaches the demos and the ceiling
    m2 = prepare.prepare(validate_params(p))
    sft = load_jsonl("data/prepared/sft_train.jsonl")
    knobs = {"slip_prob": 0.3, "max_moves": 10}
    assert m2["test_ceiling"] == gridworld.ceiling(load_jsonl("data/prepared/test.jsonl"), knobs, {"demo_explore": 0.5})
    assert m2["test_ceiling"]["demo_policy"] < m["test_ceiling"]["demo_policy"]
    assert m2["demo_calls_per_example"] > m["demo_calls_per_example"]  # the wandering is in the SFT data
    assert len(sft) == 20

    p["environments"]["gridworld"].update(demo_explore=0.0, look=True, demo_look=1.0)  # the look knobs reach the demos
    m3 = prepare.prepare(validate_params(p))
    sft = load_jsonl("data/prepared/sft_train.jsonl")
    assert all("<<look=" in r["completion"][0]["content"] for r in sft)
    assert m3["test_ceiling"] == m["test_ceiling"]  # looking changes no move: the teacher's chances are the same


def _params_error(change) -> str:
    from agentrl.config import ParamsError, validate_params

    p = mini_params()
    change(p)
    with pytest.raises(ParamsError) as e:
        validate_params(p)
    return str(e.value)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda p: p["agent"].update(environment="countdown"), r"agent\.environment and agent\.tools are both set"),
        (lambda p: p["agent"].update(tools=[], environment="sokoban"), r"unknown environment 'sokoban'"),
        (lambda p: p["environments"]["countdown"].update(num_numbrs=4), r"countdown\.num_numbrs: unknown knob"),
        (lambda p: p["environments"]["gridworld"].update(size="4"), r"gridworld\.size: expected int, got '4'"),
        (lambda p: p["environments"]["countdown"].update(use_all=1), r"countdown\.use_all: expected bool, got 1"),
        (lambda p: p["environments"]["countdown"].pop("num_train"), r"countdown: missing num_train"),
        (lambda p: p["environments"].update(sokoban={"num_train": 1, "num_test": 1}), r"unknown environment 'sokoban'"),
    ],
)
def test_config_errors_name_the_field(change, match):
    import re

    msg = _params_error(change)
    assert re.search(match, msg), msg


def test_unknown_custom_environment_is_refused_by_name():
    with pytest.raises(ValueError, match=r"agent\.environment: cannot import 'agentrl\.nope:Env'"):
        make_toolset(None, "chat", environment="agentrl.nope:Env")
    with pytest.raises(ValueError, match=r"agent\.format 'inline' .* drives one tool"):
        make_toolset(None, "inline", environment=f"{HERE}:TwoTools")


class TwoTools(Tally):
    def tock(self, note: str) -> str:
        """Another tool.

        Args:
            note: anything.
        """
        return note


def test_sft_check_lengths_names_the_key_when_nothing_fits():
    from agentrl.config import validate_params
    from agentrl.stages.sft import check_lengths

    feats = [{"input_ids": list(range(15)), "completion_mask": [0] * 10 + [1] * 5}] * 3
    p = mini_params()
    p["sft"]["trainer"]["max_length"] = 8
    with pytest.raises(ValueError, match=r"sft\.trainer\.max_length=8 leaves no trainable example.* at least 15"):
        check_lengths(feats, validate_params(p))
    p["sft"]["trainer"]["max_length"] = 11
    check_lengths(feats, validate_params(p))  # one completion token fits: trainable


def test_sft_check_calls_warns_when_demonstrations_outrun_max_tool_calls():
    """A demonstration with more calls than agent.max_tool_calls is one the loop would cut off: the warning names the
    count, the row, the file and the value to raise the key to; within the limit it says nothing."""
    from agentrl.config import validate_params
    from agentrl.stages.sft import check_calls

    p = mini_params()
    p["agent"]["max_tool_calls"] = 4
    rows = [{"id": "a"}, {"id": "b"}, {"id": "c"}]
    msg = check_calls([3, 6, 5], rows, validate_params(p))
    assert msg is not None
    assert "2 of 3 demonstrations" in msg and "agent.max_tool_calls=4" in msg
    assert "most: 6, row b" in msg and "Raise agent.max_tool_calls to 6" in msg and "sft_train.jsonl" in msg
    assert check_calls([3, 4, 0], rows, validate_params(p)) is None


def test_a_served_prompt_resets_an_environment_from_its_user_turn():
    """The server has token ids only: serving.engine.served_row gives the environment the last user turn's text, from
    which countdown and gridworld read their instance."""
    from agentrl.envs import countdown, gridworld
    from agentrl.serving.engine import served_row
    from conftest import tiny_lm

    q_cd = "Make 24 from 3 8 5 using + - * / once each."
    q_gw = gridworld.question(["S..O", ".O..", "....", "O..G"])
    tok, _ = tiny_lm([q_cd, q_gw], 300)

    def ids(q):
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]

    assert served_row(tok, ids(q_cd)) == {"question": q_cd} and served_row(tok, ids(q_gw)) == {"question": q_gw}
    env = countdown.Countdown()
    env.reset(**served_row(tok, ids(q_cd)))
    assert env.check("(5-3)*8+8") == "error: 8 used twice" and env.check("3*8") == "error: 5 unused"
    walker = gridworld.GridWorld()
    walker.reset(**served_row(tok, ids(q_gw)))
    assert walker.position == [0, 0]


def test_chat_base_tokenizer_takes_the_tool_description_as_one_token(workdir):
    """In the chat format every prompt starts with Qwen3's tool description (~1 kB): the tiny base model's tokenizer
    holds that system block as one added token, so a prompt costs tens of tokens, and decoding gives the text back."""
    from transformers import AutoTokenizer

    from agentrl.agent.tools import toolset_from_params
    from agentrl.config import load_params
    from agentrl.stages import base, prepare
    from conftest import mini_params, write_params

    p = mini_params()
    p["agent"]["format"] = "chat"
    p["model"]["pretrain"]["enabled"] = False
    write_params(workdir / "params.yaml", p)
    params = load_params()
    prepare.prepare(params)
    base.build_tiny(params)
    tok = AutoTokenizer.from_pretrained(workdir / "models/base")
    kw = toolset_from_params(params.agent, env_params=params.environments).chat_template_kwargs()
    row = json.loads((workdir / "data/prepared/sft_train.jsonl").read_text().splitlines()[-1])
    text = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False, **kw)
    block = text[text.index("# Tools") : text.index("<|im_end|>")]
    assert "calculator" in block and len(block) > 500
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids(block) in ids
    assert len(ids) < len(tok(block.replace("calculator", "calc"), add_special_tokens=False)["input_ids"]) / 2
    assert tok.decode(ids) == text
    # a system prompt before it, and the server's tokenization (each message content apart): the same one token
    from agentrl.serving.engine import chat_prompt_ids

    with_system = [{"role": "system", "content": "Be brief."}, *row["prompt"]]
    for msgs in (row["prompt"], with_system):
        assert tok.convert_tokens_to_ids(block) in chat_prompt_ids(tok, msgs, kw)


def test_grpo_summary_falls_back_to_trls_tool_metric_in_trls_loop():
    """grpo_train.json's tool_calls_per_completion_last: our loop's tools/tool_calls_per_problem, else (agent.format
    chat, TRL's environment_factory loop) TRL's tools/call_frequency; it was null for chat runs."""
    from agentrl.stages.grpo import _series

    keys = ("tools/tool_calls_per_problem", "tools/call_frequency")
    trl = [{"tools/call_frequency": 1.5}, {"loss": 0.1}, {"tools/call_frequency": 2.0}]
    assert _series(trl, *keys) == [1.5, 2.0]
    ours = [{"tools/tool_calls_per_problem": 3.0, "tools/call_frequency": 9.0}]
    assert _series(ours, *keys) == [3.0]
    assert _series([{"loss": 1.0}], *keys) == []
