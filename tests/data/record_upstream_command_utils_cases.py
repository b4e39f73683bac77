"""Records tests/data/upstream_command_utils_cases.json: the commands upstream slime's
slime/utils/external_utils/command_utils.py builds (execute_train, convert_checkpoint, hf_download_dataset,
fp8_cast_bf16, rsync_simple) and its pure helpers' results, on the inputs below. Nothing is run: exec_command is
replaced by a recorder (check_has_nvlink's probe answers "0"); the checkout's path is written as {REPO}.
    mkdir -p /tmp/up/slime/utils/external_utils
    git -C UPSTREAM show COMMIT:slime/utils/external_utils/command_utils.py \
        > /tmp/up/slime/utils/external_utils/command_utils.py
    python tests/data/record_upstream_command_utils_cases.py /tmp/up COMMIT OUT.json
"""
import json
import os
import sys
import types

root, commit, out = sys.argv[1:4]
commands = []


def record(cmd, capture_output=False):
    commands.append(cmd)
    return "0\n" if capture_output else None


def module(name, **attrs):
    m = sys.modules[name] = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


for name in ("slime", "slime.utils", "slime.utils.external_utils"):
    module(name)
module("slime.utils.misc", exec_command=record)
module("slime.utils.external_utils.typer_utils", dataclass_cli=lambda f: f)
path = f"{root}/slime/utils/external_utils/command_utils.py"
U = module("slime.utils.external_utils.command_utils", __file__=path)
exec(compile(open(path).read(), path, "exec"), U.__dict__)
REPO = str(U.repo_base_dir)


def run(fn, env=None, **kwargs):
    saved = dict(os.environ)
    os.environ.update(env or {})
    commands.clear()
    try:
        fn(**kwargs)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return [c.replace(REPO, "{REPO}") for c in commands]


for key in ("SLIME_SCRIPT_EXTERNAL_RAY", "SLIME_SCRIPT_ENABLE_RAY_SUBMIT", "MASTER_ADDR", "WANDB_API_KEY",
            "GITHUB_COMMIT_NAME", "SLURM_JOB_HOSTNAMES", "SLURM_NODEID"):
    os.environ.pop(key, None)
TRAIN = [
    dict(kwargs=dict(train_args="--num-rollout 3 --rollout-batch-size 4 ", num_gpus_per_node=4,
                     megatron_model_type="qwen3-4B"), env={}),
    dict(kwargs=dict(train_args="--hf-checkpoint /m --colocate", num_gpus_per_node=8, megatron_model_type=None,
                     train_script="train_async.py", extra_env_vars={"A": "1", "B": "x y"}),
         env={"SLIME_SCRIPT_EXTERNAL_RAY": "1", "MASTER_ADDR": "10.0.0.7"}),
    dict(kwargs=dict(train_args="--lr 1e-6", num_gpus_per_node=2, megatron_model_type="glm5-tiny",
                     config=dict(cuda_core_dump=True, extra_env_vars='{"K": "v", "N": 3}')), env={}),
    dict(kwargs=dict(train_args="--lr 1e-6", num_gpus_per_node=1, megatron_model_type="qwen3-4B",
                     config=dict(extra_env_vars="X=1 Y=two")), env={"SLIME_SCRIPT_ENABLE_RAY_SUBMIT": "0"}),
]
train = []
for case in TRAIN:
    kwargs = dict(case["kwargs"])
    if "config" in kwargs:
        kwargs["config"] = U.ExecuteTrainConfig(**kwargs["config"])
    train.append(dict(case, commands=run(U.execute_train, case["env"], **kwargs)))

CONVERT = [
    dict(kwargs=dict(model_name="Qwen3-4B", megatron_model_type="qwen3-4B", num_gpus_per_node=8), env={}),
    dict(kwargs=dict(model_name="M", megatron_model_type="glm5-tiny", num_gpus_per_node=2, extra_args="  --x 1 ",
                     dir_dst="/data", hf_checkpoint="/ckpt/M"), env={}),
    dict(kwargs=dict(model_name="M", megatron_model_type="glm5-tiny", num_gpus_per_node=4, multinode=True),
         env={"SLURM_JOB_HOSTNAMES": "node-a\nnode-b\nnode-c", "SLURM_NODEID": "2"}),
]
convert = [dict(case, commands=run(U.convert_checkpoint, case["env"], **case["kwargs"])) for case in CONVERT]

WANDB = [dict(test_file="/x/tests/test_qwen3_4B_ppo.py", run_id="RID", env={"WANDB_API_KEY": "k1"}),
         dict(test_file="/x/e2e/short.py", run_id="RID", run_name_prefix="pre",
              env={"WANDB_API_KEY": "k2", "GITHUB_COMMIT_NAME": "abc"}),
         dict(test_file="/x/tests/test_a.py", run_id="RID", env={})]
wandb = []
for case in WANDB:
    saved = dict(os.environ)
    os.environ.update(case["env"])
    kwargs = {k: v for k, v in case.items() if k != "env"}
    wandb.append(dict(case, result=U.get_default_wandb_args(**kwargs)))
    os.environ.clear()
    os.environ.update(saved)

EXTRA = ['{"A": "1"}', "A=1 B=2", "  A=1   B=x ", "", '{"N": 3, "S": "s"}']
BOOLS = [(None, "false"), (None, "1"), ("TRUE", "false"), ("0", "1"), ("yes", "true"), ("False", "true")]
bools = []
for value, default in BOOLS:
    os.environ.pop("CU_BOOL", None)
    if value is not None:
        os.environ["CU_BOOL"] = value
    bools.append([value, default, U.get_bool_env_var("CU_BOOL", default)])

json.dump(dict(
    repository="THUDM/slime", commit=commit, execute_train=train, convert_checkpoint=convert,
    hf_download_dataset=[["zhuzilin/dapo-math-17k", run(U.hf_download_dataset, full_name="zhuzilin/dapo-math-17k")]],
    fp8_cast_bf16=[["/a/fp8", "/nonexistent/bf16", run(U.fp8_cast_bf16, path_src="/a/fp8",
                                                       path_dst="/nonexistent/bf16")]],
    rsync_simple=[["/a/src", "/b/dst", run(U.rsync_simple, path_src="/a/src", path_dst="/b/dst")]],
    wandb=wandb, extra_env_vars=[[t, U._parse_extra_env_vars(t)] for t in EXTRA], bool_env=bools,
    num_gpus_of_hardware=U.NUM_GPUS_OF_HARDWARE, generation_hardware=U.GENERATION_HARDWARE,
), open(out, "w"), indent=1)
print(f"wrote {out}")
