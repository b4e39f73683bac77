"""PPO with a critic and on-policy distillation on the trainer rank in-process (world size 1, no Ray), on the
tiny GLM-5 checkpoint: the critic's value loss falls, the actor waits --num-critic-only-steps, the actor's
advantages are GAE against the critic's old values (not GRPO's), the critic checkpoints and resumes; the OPD
teacher's log-probs are the teacher checkpoint's (transformers, float64), they change the advantages and the
gradient, and a teacher equal to the student changes nothing. Plus the flags' one-line errors."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from test_ppo_math import _gae_reference

from slime.config.arguments import parse_args


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from slime_plugins.models.common.tiny import write_tiny_checkpoint

    d = tmp_path_factory.mktemp("ppo")
    roles = d / "roles.yaml"
    roles.write_text("megatron:\n  - name: default\n    role: critic\n    overrides:\n      lr: 3e-3\n"
                     "  - name: default\n    role: actor\n    overrides:\n      lr: 1e-3\n")
    return {"student": write_tiny_checkpoint(str(d / "student")),
            "teacher": write_tiny_checkpoint(str(d / "teacher"), seed=1), "roles": str(roles), "dir": d}


@pytest.fixture(scope="module")
def actor_and_args(ckpts):
    from slime.backends.megatron.actor import MegatronTrainRayActor

    args = parse_args(["--hf-checkpoint", ckpts["student"], "--num-rollout", "20", "--global-batch-size", "6",
                       "--use-dynamic-batch-size", "--max-tokens-per-gpu", "24", "--lr", "5e-3",
                       "--advantage-estimator", "ppo", "--num-critic-only-steps", "2", "--gamma", "0.99",
                       "--megatron-config-path", ckpts["roles"], "--n-samples-per-prompt", "2",
                       "--use-opd", "--opd-type", "megatron", "--opd-teacher-load", ckpts["teacher"],
                       "--opd-kl-coef", "0.5", "--save", str(ckpts["dir"] / "save")])
    actor = MegatronTrainRayActor(1, 0)
    assert actor.init(args) == 0 and actor.teacher_weights is not None
    args.use_opd = False  # the tests turn it on where they need it
    return actor, args


def _payload(seed=0, n=6):
    from slime.backends.megatron.rollout_data import pack_samples

    rng = random.Random(seed)
    samples = []
    for i in range(n):
        length = rng.randint(4, 12)
        r = rng.randint(1, length - 1)
        samples.append(SimpleNamespace(tokens=[rng.randrange(3, 500) for _ in range(length)], response_length=r,
                                       reward=float(i % 2), loss_mask=[int(rng.random() > 0.2) or j == 0 for j in range(r)],
                                       rollout_log_probs=None))
    return pack_samples(samples)


def test_role_overrides_reach_actor_and_critic(actor_and_args):
    actor, args = actor_and_args
    assert args.lr == pytest.approx(1e-3) and args.critic_args.lr == pytest.approx(3e-3)  # YAML over --lr 5e-3
    assert args.critic_args.kl_coef == 0.0 and args.use_critic
    head = actor.critic.model.module.output_layer
    assert tuple(head.weight.shape) == (1, actor.critic.model.module.arch.hidden_size)
    assert 0.005 < float(head.weight.std()) < 0.05 and float(head.bias.abs().max()) == 0.0  # N(0, 0.02), bias 0


def test_critic_learns_and_actor_waits_for_the_critic_only_steps(actor_and_args):
    """--num-critic-only-steps 2: rollouts 0 and 1 leave the actor's weights as they are; the critic's value
    loss against fixed Monte Carlo targets (one payload, lambd 1) falls over its steps."""
    from slime.backends.megatron.model_setup import host_copy

    actor, args = actor_and_args
    payload = _payload(0)
    before = host_copy(actor.model)
    losses = []
    for rollout_id in range(2):
        m = actor.train_rollout(rollout_id, payload, False)
        assert m["train/actor_trained"] == 0.0 and "train/loss" not in m
        losses.append(m["critic/value_loss"])
    assert all(torch.equal(v, before[k]) for k, v in host_copy(actor.model).items())
    m = actor.train_rollout(2, payload, False)
    assert "train/loss" in m and any(not torch.equal(v, before[k]) for k, v in host_copy(actor.model).items())
    losses.append(m["critic/value_loss"])
    for rollout_id in range(3, 8):
        losses.append(actor.train_rollout(rollout_id, payload, False)["critic/value_loss"])
    # measured: 0.48 -> 0.06 over 8 critic steps at lr 3e-3
    assert losses[-1] < 0.3 * losses[0], losses


def test_actor_advantages_are_gae_against_the_critics_old_values(actor_and_args):
    """The critic hands V_old (its values before its update) to the actor; the actor's advantages equal a
    float64 GAE of the token rewards against them, differ from GRPO's, and would differ with other values."""
    from slime.backends.megatron.rollout_data import batch_from_payload, share_advantages

    actor, args = actor_and_args
    batch = batch_from_payload(_payload(3))
    mine = list(range(len(batch)))
    fresh = actor.critic.values_of(batch, mine)
    actor.critic.train_rollout(9, batch, mine)
    assert all(torch.equal(batch.values[i], fresh[i]) for i in mine)  # the old values, not the updated ones
    after = actor.critic.values_of(batch, mine)
    assert max(float((after[i] - fresh[i]).abs().max()) for i in mine) > 1e-4  # the critic stepped
    assert max(float(fresh[i].abs().max()) for i in mine) > 1e-2
    share_advantages(args, batch, mine)
    for i in mine:
        token = [0.0] * batch.response_lengths[i]
        token[-1] = batch.rewards[i]
        ref, _ = _gae_reference(token, batch.values[i].double().tolist(), args.gamma, args.lambd)
        torch.testing.assert_close(torch.as_tensor(batch.advantages[i]).double(), torch.tensor(ref, dtype=torch.float64),
                                   atol=1e-5, rtol=1e-5)
        zero_critic, _ = _gae_reference(token, [0.0] * len(token), args.gamma, args.lambd)
        assert max(abs(a - b) for a, b in zip(ref, zero_critic)) > 1e-3
    grpo = SimpleNamespace(**{**vars(args), "advantage_estimator": "grpo"})
    ppo_adv = [a.copy() for a in batch.advantages]
    share_advantages(grpo, batch, mine)
    assert max(float(abs(a - b).max()) for a, b in zip(ppo_adv, batch.advantages)) > 0.1


def test_critic_checkpoint_resumes(actor_and_args):
    from slime.backends.megatron.critic import Critic
    from slime.backends.megatron.model_setup import host_copy

    actor, args = actor_and_args
    actor.save(4, {})
    saved = host_copy(actor.critic.model)
    resumed = Critic(actor.policy, SimpleNamespace(**{**vars(args), "load": args.save}))
    assert all(torch.equal(v, saved[k]) for k, v in host_copy(resumed.model).items())
    assert resumed.lr_scheduler.num_steps == 5  # rollout 5 is next: the schedule continues there
    fresh = Critic(actor.policy, SimpleNamespace(**{**vars(args), "load": None}))
    assert any(not torch.equal(v, saved[k]) for k, v in host_copy(fresh.model).items())


def test_offload_train_releases_and_restores_the_critic(actor_and_args, monkeypatch):
    """--offload-train: the critic's weights and optimizer state are released with the actor's and come back
    bit for bit (the CPU device keeps memory on the host, so its check is bypassed here)."""
    from slime.accelerator import get_accelerator
    from slime.backends.megatron.model_setup import host_copy

    actor, _ = actor_and_args
    monkeypatch.setattr(type(get_accelerator()), "memory_is_host", lambda self: False)
    saved = host_copy(actor.critic.model)
    params = list(actor.critic.model.module.parameters())
    try:
        assert actor.offload() > 0
        assert all(p.untyped_storage().nbytes() == 0 for p in params)
    finally:
        actor.onload()
    assert all(torch.equal(v, saved[k]) for k, v in host_copy(actor.critic.model).items())


def _teacher_reference(path, batch):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s, r in zip(batch.tokens, batch.response_lengths):
            logp = torch.log_softmax(hf(torch.tensor([s])).logits[0].double(), -1)
            out.append(torch.stack([logp[j - 1, s[j]] for j in range(len(s) - r, len(s))]))
    return out


def _opd_step(actor, args, payload, opd: bool):
    """One actor step on `payload` at lr 0 (weights kept); returns the step's grads and the batch."""
    from slime.backends.megatron import model_setup
    from slime.backends.megatron.rollout_data import batch_from_payload, share_advantages

    args.use_opd = opd
    try:
        batch = batch_from_payload(payload)
        mine = list(range(len(batch)))
        batch.values = [torch.zeros(r) for r in batch.response_lengths]  # a fixed critic: only OPD differs
        old = actor._log_probs_of(batch, mine)
        batch.old_log_probs = [old[i] for i in mine]
        with model_setup.swapped_weights(actor.model, actor.teacher_weights):
            batch.teacher_log_probs = [actor._log_probs_of(batch, mine)[i] for i in mine]
        share_advantages(args, batch, mine)
        groups = actor.optimizer.param_groups
        lrs = [g["lr"] for g in groups]
        for g in groups:
            g["lr"] = 0.0
        actor.train(0, batch)
        for g, lr in zip(groups, lrs):
            g["lr"] = lr
        grads = {n: p.main_grad.detach().clone() for n, p in actor.model.module.named_parameters()
                 if getattr(p, "main_grad", None) is not None}
        assert grads
        return grads, batch
    finally:
        args.use_opd = False


def test_opd_teacher_log_probs_advantage_and_gradient(actor_and_args, ckpts):
    """--opd-type megatron: the teacher's log-probs are the teacher checkpoint's (transformers float64, 2e-5);
    advantage = PPO's - 0.5 * (student - teacher) (float64); the gradient differs from the run without OPD."""
    actor, args = actor_and_args
    payload = _payload(5)
    grads_opd, batch = _opd_step(actor, args, payload, True)
    grads_plain, plain = _opd_step(actor, args, payload, False)
    for i, ref in enumerate(_teacher_reference(ckpts["teacher"], batch)):
        torch.testing.assert_close(batch.teacher_log_probs[i].double(), ref, atol=2e-5, rtol=0)
        term = -0.5 * (batch.old_log_probs[i].double() - batch.teacher_log_probs[i].double())
        torch.testing.assert_close(torch.as_tensor(batch.advantages[i]).double(),
                                   torch.as_tensor(plain.advantages[i]).double() + term, atol=1e-5, rtol=1e-5)
    assert max(float((batch.old_log_probs[i] - batch.teacher_log_probs[i]).abs().max()) for i in range(6)) > 0.1
    diff = max(float((grads_opd[k] - grads_plain[k]).abs().max()) for k in grads_opd)
    assert diff > 1e-4 * max(float(g.abs().max()) for g in grads_plain.values())


def test_opd_with_the_student_as_teacher_changes_nothing(actor_and_args):
    from slime.backends.megatron.model_setup import host_copy

    actor, args = actor_and_args
    payload = _payload(6)
    teacher = actor.teacher_weights
    actor.teacher_weights = host_copy(actor.model)
    try:
        grads_opd, batch = _opd_step(actor, args, payload, True)
        grads_plain, plain = _opd_step(actor, args, payload, False)
    finally:
        actor.teacher_weights = teacher
    for i in range(len(batch)):
        assert torch.equal(batch.teacher_log_probs[i], batch.old_log_probs[i])
        assert (batch.advantages[i] == plain.advantages[i]).all()
    assert all(torch.equal(grads_opd[k], grads_plain[k]) for k in grads_opd)


def test_opd_sglang_teacher_log_probs_travel_in_the_payload():
    """--opd-type sglang: Sample.teacher_log_probs (set by the rollout) reach the trainer's batch; a wrong count
    is refused in one line."""
    from slime.backends.megatron.rollout_data import batch_from_payload, pack_samples

    samples = [SimpleNamespace(tokens=[5, 6, 7, 8], response_length=2, reward=1.0, loss_mask=None, rollout_log_probs=None,
                               teacher_log_probs=[-0.5, -1.25], index=0),
               SimpleNamespace(tokens=[5, 6, 9], response_length=1, reward=0.0, loss_mask=None, rollout_log_probs=None,
                               teacher_log_probs=[-2.0], index=1)]
    batch = batch_from_payload(pack_samples(samples))
    assert [t.tolist() for t in batch.teacher_log_probs] == [[-0.5, -1.25], [-2.0]]
    samples[1].teacher_log_probs = [-2.0, -1.0]
    with pytest.raises(ValueError, match=r"^sample 1: 2 teacher log-probs for a response of 1 tokens"):
        pack_samples(samples)
    samples[1].teacher_log_probs = None
    assert batch_from_payload(pack_samples(samples)).teacher_log_probs is None


@pytest.mark.parametrize("extra,message", [
    (["--use-opd"], "--use-opd needs --opd-type sglang or --opd-type megatron"),
    (["--use-opd", "--opd-type", "megatron"], "--opd-type megatron needs --opd-teacher-load"),
    (["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "/nonexistent/t"], "does not exist"),
    (["--use-opd", "--opd-type", "sglang", "--opd-teacher-load", "."], "--opd-teacher-load is for --opd-type megatron"),
    (["--opd-teacher-load", "."], "--opd-teacher-load is set but --use-opd is not"),
    (["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "EMPTY"], "--opd-teacher-load"),
    (["--num-critic-only-steps", "1"], "--num-critic-only-steps needs --advantage-estimator ppo"),
    (["--advantage-estimator", "ppo", "--value-clip", "0"], "--value-clip must be > 0"),
    (["--advantage-estimator", "ppo", "--megatron-config-path", "ROLES:lrr: 1"], "override 'lrr' is not a train.py flag"),
    (["--advantage-estimator", "ppo", "--megatron-config-path", "ROLES:tensor_model_parallel_size: 2"],
     "different layouts"),
    (["--advantage-estimator", "ppo", "--megatron-config-path", "ROLES:lr: fast"], "lr='fast' is not a number"),
])
def test_flag_errors_are_one_line(ckpts, tmp_path, extra, message, capsys):
    argv = ["--hf-checkpoint", ckpts["student"], "--num-rollout", "1", "--global-batch-size", "2"]
    for k, v in enumerate(extra):
        if v == "EMPTY":
            (tmp_path / "empty").mkdir()
            extra[k] = str(tmp_path / "empty")
        if v.startswith("ROLES:"):
            roles = tmp_path / "roles.yaml"
            roles.write_text(f"megatron:\n  - role: critic\n    overrides:\n      {v[6:]}\n")
            extra[k] = str(roles)
    with pytest.raises(SystemExit) as e:
        parse_args(argv + extra)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_opd_sglang_hooks_against_a_stand_in_teacher_server():
    """slime.rollout.on_policy_distillation (upstream's example hooks): reward_func posts SGLang's scoring request
    (max_new_tokens 0, return_logprob, logprob_start_len 0) to --rm-url on 127.0.0.1 and keeps the teacher's
    log-probs of the response tokens; they reach the trainer's batch and its OPD term."""
    import asyncio

    from json_http import JsonHandler, serve

    from slime.backends.megatron.rollout_data import batch_from_payload, pack_samples, share_advantages
    from slime.rollout import on_policy_distillation as opd
    from slime.utils.types import Sample

    seen = []

    def teacher_lp(token: int) -> float:
        return -((token * 7) % 11) / 10.0

    class Teacher(JsonHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = self.body()
            seen.append((self.path, body))
            ids = body["input_ids"]
            entries = [[None, ids[0], "x"]] + [[teacher_lp(t), t, "x"] for t in ids[1:]]
            self.reply(200, {"text": "", "meta_info": {"input_token_logprobs": entries, "finish_reason": {"type": "length"}}})

    server, url = serve(Teacher)
    try:
        args = SimpleNamespace(rm_url=url + "/generate", rollout_temperature=0.8, reward_key=None, use_opd=True,
                               opd_type="sglang", opd_kl_coef=0.5, use_rollout_logprobs=False, advantage_estimator="grpo",
                               kl_loss_type="k1", kl_coef=0.0, n_samples_per_prompt=2, rollout_batch_size=2, gamma=1.0,
                               disable_grpo_std_normalization=False, normalize_advantages=False,
                               rewards_normalization=True, custom_reward_post_process_path=None,
                               custom_convert_samples_to_train_data_path=None, lambd=1.0,
                               custom_advantage_function_path=None)
        samples = [Sample(index=i, tokens=t, response_length=r) for i, (t, r) in
                   enumerate([([5, 9, 13, 2], 2), ([5, 9, 40], 1), ([8, 3, 3, 3, 7], 3), ([8, 3, 1], 2)])]
        rewards = [asyncio.run(opd.reward_func(args, s)) for s in samples]
    finally:
        server.shutdown()
    assert rewards == [0.0] * 4 and seen[0][0] == "/generate"
    assert seen[0][1] == {"input_ids": [5, 9, 13, 2], "return_logprob": True, "logprob_start_len": 0,
                          "sampling_params": {"temperature": 0.8, "max_new_tokens": 0, "skip_special_tokens": False}}
    for s in samples:
        s.reward = 0.0
        assert s.teacher_log_probs == [teacher_lp(t) for t in s.tokens[-s.response_length:]]
    assert opd.post_process_rewards(args, samples) == ([0.0] * 4, [0.0] * 4)
    batch = batch_from_payload(pack_samples(samples))
    batch.old_log_probs = [torch.full((r,), -0.25) for r in batch.response_lengths]
    share_advantages(args, batch, range(4))
    for i, s in enumerate(samples):  # equal rewards: GRPO's part is 0, the OPD term is all
        ref = [-0.5 * (-0.25 - teacher_lp(t)) for t in s.tokens[-s.response_length:]]
        torch.testing.assert_close(torch.as_tensor(batch.advantages[i]).double(), torch.tensor(ref, dtype=torch.float64),
                                   atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="input_token_logprobs for a response of 5 tokens"):
        opd.response_log_probs({"meta_info": {"input_token_logprobs": [[None, 1], [-1.0, 2]]}}, 5)


def test_each_role_overrides_the_command_line(ckpts, tmp_path):
    """Upstream's --megatron-config-path: a role without an entry keeps the command line's values (the critic does
    not inherit the actor's overrides); YAML text numbers are converted."""
    roles = tmp_path / "roles.yaml"
    roles.write_text("megatron:\n  - role: actor\n    overrides:\n      lr: 2e-6\n      num_nodes: 4\n")
    args = parse_args(["--hf-checkpoint", ckpts["student"], "--num-rollout", "1", "--global-batch-size", "2",
                       "--lr", "1e-5", "--advantage-estimator", "ppo", "--megatron-config-path", str(roles)])
    assert args.lr == 2e-6 and args.critic_args.lr == 1e-5 and args.critic_args.kl_coef == 0.0


def test_the_critic_beside_the_actor_is_one_warning_line(ckpts):
    from slime.config.upstream_differences import upstream_difference_warnings

    argv = ["--hf-checkpoint", ckpts["student"], "--num-rollout", "1", "--global-batch-size", "2"]
    assert upstream_difference_warnings(parse_args(argv)) == []
    (line,) = upstream_difference_warnings(parse_args(argv + ["--advantage-estimator", "ppo"]))
    assert line.startswith("warning: --advantage-estimator ppo: the critic") and "\n" not in line
