"""Twin Delayed DDPG (TD3) for continuous actions: the torch.compile / CUDA-graph twin.

Fujimoto et al., "Addressing Function Approximation Error in Actor-Critic Methods", 2018,
https://arxiv.org/abs/1802.09477. Twin Q-networks (the smaller target wins), target policy
smoothing, delayed actor and target updates, Gaussian exploration noise, with CleanRL's
hyper-parameters. The compiled twin, td3_continuous_action_torchcompile.py, computes the same with stacked
Q-networks under torch.vmap, torch.compile, CUDA graphs and an acting copy of the policy: `diff` the two files to
see what compiling takes.

    python leanrl/td3_continuous_action_torchcompile.py --compile --cudagraphs
"""

import contextlib
import copy
import csv
import dataclasses
import difflib
import importlib.util
import itertools
import json
import logging
import math
import os
import signal
import sys
import time
import warnings
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Optional

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tqdm
import tyro
from tensordict import from_module, from_modules
from tensordict.nn import CudaGraphModule


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = True
    """if toggled, cuda will be used when available (else the CPU, with a note)"""
    track: bool = False
    """if toggled, this experiment will be tracked with Weights and Biases (honours WANDB_MODE)"""
    wandb_project_name: str = "leanrl"
    """the wandb's project name"""
    wandb_entity: Optional[str] = None
    """the entity (team) of wandb's project"""
    capture_video: bool = False
    """whether to capture videos of the agent performances (check out `videos` folder; needs moviepy)"""
    save_model: bool = False
    """whether to save a checkpoint (weights, optimisers, RNG, step, args) to runs/{run_name}/checkpoint.pt"""
    checkpoint_every: int = 0
    """with --save-model, also save the checkpoint every this many steps (0: only at the end)"""
    save_buffer: bool = False
    """with --save-model, the checkpoint holds the replay buffer too (HalfCheetah-v5: 168 MB per million steps)"""
    resume: Optional[str] = None
    """a checkpoint.pt to continue: its env, seed and hyper-parameters; a larger --total-timesteps extends the run"""
    eval_episodes: Optional[int] = None
    """episodes to evaluate the deterministic final policy; default 10 with --save-model, else 0"""

    # Algorithm specific arguments
    env_id: str = "HalfCheetah-v5"
    """the id of the environment"""
    total_timesteps: int = 1_000_000
    """total timesteps of the experiments"""
    num_envs: int = 1
    """the number of parallel game environments"""
    buffer_size: int = 1_000_000
    """the replay memory buffer size"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 0.005
    """target smoothing coefficient"""
    batch_size: int = 256
    """the batch size of sample from the replay memory"""
    learning_starts: int = 25_000
    """steps of uniformly random actions before learning (resumed without a saved buffer, the policy refills it)"""
    learning_rate: float = 3e-4
    """the learning rate of the optimizers"""
    policy_noise: float = 0.2
    """the scale of the target policy smoothing noise (a fraction of the action range)"""
    exploration_noise: float = 0.1
    """the scale of the exploration noise (a fraction of the action range)"""
    policy_frequency: int = 2
    """the frequency of training policy (delayed); the targets are updated with it"""
    noise_clip: float = 0.5
    """noise clip parameter of the target policy smoothing regularization"""

    # Performance
    compile: bool = False
    """whether to compile the updates and the policy with torch.compile"""
    cudagraphs: bool = False
    """whether to replay the updates and the policy as CUDA graphs (CUDA only: on a CPU it warns and runs without)"""
    measure_burnin: int = 10
    """training iterations (compile, warm-up) left out of the steady-state sps"""
    log_every: int = 100
    """iterations between two reads of the losses (each read synchronises host and device)"""


def make_env(env_id, seed, idx, capture_video, run_name):
    def thunk():
        if capture_video and idx == 0:
            env = gym.make(env_id, render_mode="rgb_array")
            env = gym.wrappers.RecordVideo(env, f"videos/{run_name}")
        else:
            env = gym.make(env_id)
        env.action_space.seed(seed)
        return env

    return thunk


def transition_rows(obs, actions, rewards, next_obs, terminations, infos):
    """The replay rows (num_envs, obs + act + 1 + obs + 1), float32, of one vector step. An env whose episode just
    ended returns its reset observation as next_obs and the true last one in infos["final_obs"]: that is the one
    to store. Only terminations are stored as dones: a time-limit truncation still bootstraps."""
    real_next_obs = next_obs.copy()
    if "final_obs" in infos:
        for i in np.flatnonzero(infos["_final_obs"]):
            real_next_obs[i] = infos["final_obs"][i]
    rows = [obs, actions, rewards[:, None], real_next_obs, terminations[:, None]]
    return np.concatenate(rows, axis=1, dtype=np.float32)


class QNetwork(nn.Module):
    def __init__(self, n_obs, n_act, device=None):
        super().__init__()
        self.fc1 = nn.Linear(n_obs + n_act, 256, device=device)
        self.fc2 = nn.Linear(256, 256, device=device)
        self.fc3 = nn.Linear(256, 1, device=device)

    def forward(self, x, a):
        x = torch.cat([x, a], 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class Actor(nn.Module):
    def __init__(self, n_obs, action_space, device=None):
        super().__init__()
        self.fc1 = nn.Linear(n_obs, 256, device=device)
        self.fc2 = nn.Linear(256, 256, device=device)
        self.fc_mu = nn.Linear(256, math.prod(action_space.shape), device=device)
        # action rescaling: tanh's (-1, 1) onto [low, high]; low and high also clip the noisy actions
        high = torch.as_tensor(action_space.high, dtype=torch.float32, device=device)
        low = torch.as_tensor(action_space.low, dtype=torch.float32, device=device)
        self.register_buffer("action_scale", (high - low) / 2.0)
        self.register_buffer("action_bias", (high + low) / 2.0)
        self.register_buffer("action_low", low)
        self.register_buffer("action_high", high)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return torch.tanh(self.fc_mu(x)) * self.action_scale + self.action_bias

    def explore(self, x, noise_scale: float):
        """The deterministic action plus Gaussian noise of std noise_scale * action_scale, clipped to
        the action bounds. The noise is drawn on the device: acting needs no host random numbers."""
        action = self(x)
        noise = torch.randn_like(action) * (self.action_scale * noise_scale)
        return torch.clamp(action + noise, self.action_low, self.action_high)


def make_updates(args, actor, qnet, qnet_params, actor_target, qnet_target):
    """Builds the optimisers and the two update steps; each step is a function over tensors on the
    device with no host synchronisation, so the compiled twin can compile it whole."""
    adam = partial(torch.optim.Adam, fused=True, capturable=args.cudagraphs)  # capturable: a CUDA graph replays it
    # the stacked tensors, keyed "fc1.weight", ..., that torch.func.functional_call runs the weightless shell with
    # (tensordict's `params.to_module(qnet)` does the same, but twice in one compiled function crashes dynamo 2.13)
    q_weights = dict(qnet_params.flatten_keys(".").items())
    q_target_weights = dict(qnet_target.flatten_keys(".").items())
    # qf1's slice of the same storage, without autograd: the actor's loss must not reach the critics'
    # weights, and a compiled backward computes every gradient its graph allows
    qf1_weights_detached = {name: weight.data[0] for name, weight in q_weights.items()}
    actor_params = list(actor.parameters())
    q_params = list(q_weights.values())
    target_params = list(actor_target.parameters()) + list(q_target_weights.values())
    q_optimizer = adam(q_params, lr=args.learning_rate)
    actor_optimizer = adam(actor_params, lr=args.learning_rate)

    def batched_qf(weights, obs, action):
        return torch.func.functional_call(qnet, weights, (obs, action))

    qf = torch.vmap(batched_qf, (0, None, None))  # (2, batch, 1): both Q-networks in one batched call

    def update_critic(obs, actions, rewards, next_obs, dones):
        with torch.no_grad():
            # target policy smoothing: clipped noise on the target action, then back into the bounds
            next_actions = actor_target(next_obs)
            noise = (torch.randn_like(next_actions) * args.policy_noise).clamp(-args.noise_clip, args.noise_clip)
            next_actions = next_actions + noise * actor_target.action_scale
            next_actions = torch.clamp(next_actions, actor_target.action_low, actor_target.action_high)
            qf_next_target = qf(q_target_weights, next_obs, next_actions).min(0).values
            # (batch, 1): terminations stop the bootstrap, time-limit truncations do not (dones = terminations)
            next_q_value = rewards + (1.0 - dones) * args.gamma * qf_next_target
        qf_loss = (qf(q_weights, obs, actions) - next_q_value).pow(2).mean((1, 2)).sum()  # qf1 MSE + qf2 MSE
        q_optimizer.zero_grad()
        qf_loss.backward()
        q_optimizer.step()
        return qf_loss.detach()

    def update_actor(obs):
        actor_loss = -batched_qf(qf1_weights_detached, obs, actor(obs)).mean()
        actor_optimizer.zero_grad()
        # gradients for the actor only: the critic's weight gradients would be computed, then discarded
        actor_loss.backward(inputs=actor_params)
        actor_optimizer.step()
        # Polyak averaging of all three targets, t += tau * (p - t), after each (delayed) actor update
        with torch.no_grad():
            torch._foreach_lerp_(target_params, actor_params + q_params, args.tau)
        return actor_loss.detach()

    return {"q_optimizer": q_optimizer, "actor_optimizer": actor_optimizer}, (update_critic, update_actor)


class ReplayBuffer:
    """One float32 table on the device, a row (obs, action, reward, next_obs, termination) per transition, so
    storing costs one host-to-device copy and sampling one gather. With --save-buffer the checkpoint holds it."""

    def __init__(self, size, fields, device):
        self.fields, self.pos, self.size = fields, 0, 0
        try:
            self.rows = torch.zeros((size, sum(fields)), dtype=torch.float32, device=device)
        except (RuntimeError, MemoryError):  # out of memory: a plain message, not an allocator traceback
            fail(f"no room for a {size * sum(fields) * 4 / 2**30:.1f} GiB replay buffer on {device}: "
                 "lower --buffer-size")

    def add(self, rows):
        self.rows[self.pos : self.pos + len(rows)].copy_(torch.from_numpy(rows))
        self.pos = (self.pos + len(rows)) % len(self.rows)
        self.size = min(self.size + len(rows), len(self.rows))

    def sample(self, batch_size):  # obs, actions, rewards, next_obs, dones
        idx = torch.randint(0, self.size, (batch_size,), device=self.rows.device)
        return self.rows[idx].split(self.fields, dim=1)

    def state_dict(self):  # a copy of the filled rows, on the host: a view would save the whole table
        return {"rows": self.rows[: self.size].to("cpu", copy=True), "pos": self.pos}

    def load_state_dict(self, state):
        rows = state["rows"]
        if rows.shape[1:] != self.rows.shape[1:] or len(rows) > len(self.rows):
            fail(f"the checkpoint's replay buffer holds {len(rows)} rows of {rows.shape[1]} values, this run's up to "
                 f"{len(self.rows)} of {self.rows.shape[1]}: resume with --no-save-buffer (the buffer refills)")
        self.size, self.pos = len(rows), state["pos"]
        self.rows[: self.size].copy_(rows)


@torch.no_grad()
def evaluate(args, actor, device):
    """Mean return of --eval-episodes episodes of the actor's action without exploration noise, in a fresh env
    seeded seed + 100_000 + i: reproducible, and apart from the training episodes."""
    env, returns = gym.make(args.env_id), []
    for i in range(args.eval_episodes):
        obs, _ = env.reset(seed=args.seed + 100_000 + i)
        returns.append(0.0)
        done = False
        while not done:
            action = actor(torch.as_tensor(obs, dtype=torch.float32, device=device)[None])
            obs, reward, terminated, truncated, _ = env.step(action[0].cpu().numpy())
            returns[-1] += float(reward)
            done = terminated or truncated
    env.close()
    return float(np.mean(returns))


def env_spaces(env_id):
    """The (observation, action) spaces of a gymnasium env, or a one-line error that names the fix. For an env of
    your own, gymnasium's module:EnvId form imports the module (from where the script runs, too), which registers
    EnvId."""
    module, _, name = env_id.rpartition(":")
    if module:
        if os.getcwd() not in sys.path:  # a module beside the user; last, so an installed one of that name wins
            sys.path.append(os.getcwd())
        try:
            importlib.import_module(module)
        except Exception as e:  # not found, or its own import fails
            where = ": run from the folder that holds it, or add that folder to PYTHONPATH" if isinstance(
                e, ModuleNotFoundError) and e.name == module else ""
            fail(f"--env-id {env_id}: cannot import {module} ({type(e).__name__}: "
                 f"{str(e).splitlines()[0] if str(e) else ''}){where}")
    try:
        spec = gym.spec(name)
    except gym.error.Error:
        close = difflib.get_close_matches(name, list(gym.registry), n=3)
        hint = "have it call gymnasium.register(id=..., entry_point=...)" if module else "see gym.registry"
        fail((f"--env-id {env_id}: {module} imports, but registers no env {name!r}: " if module else
              f"unknown env id {name!r}: ") + (f"did you mean {', '.join(close)}?" if close else hint))
    if str(spec.entry_point).startswith("gymnasium.envs.mujoco"):  # its models set an attribute MuJoCo deprecates
        with contextlib.suppress(ImportError, RuntimeError, AttributeError):  # gym.make says what is wrong
            import mujoco

            keep = mujoco.get_mju_user_warning() or (lambda text: note(f"WARNING: {text}"))
            mujoco.set_mju_user_warning(lambda text: "settotalmass" in text or keep(text))
    try:
        env = gym.make(env_id)
    except (gym.error.Error, ImportError) as e:  # e.g. an env whose simulator is not installed
        fail(f"cannot make {env_id}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    env.close()
    return env.observation_space, env.action_space


def headless_gl():
    """On a Linux machine without a display: MuJoCo's GL backend (EGL, else OSMesa, whichever library is there) and
    pygame's off-screen driver, chosen before mujoco is first imported. Returns the backend it chose, if any."""
    if not sys.platform.startswith("linux") or os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"):
        return None
    import ctypes.util

    os.environ["SDL_VIDEODRIVER"] = os.environ.get("SDL_VIDEODRIVER") or "dummy"
    if os.environ.get("MUJOCO_GL"):
        return None
    backend = next((gl for gl, lib in (("egl", "EGL"), ("osmesa", "OSMesa")) if ctypes.util.find_library(lib)), None)
    if backend:  # glfw, MuJoCo's default, needs a display
        os.environ["MUJOCO_GL"] = backend
    return backend


def render_error(env_id):
    """None where env_id renders a frame here, else the one-line error: found before training, not at the first
    video."""
    try:
        with warnings.catch_warnings():  # e.g. glfw's own warnings on its way to the exception: one line says it
            warnings.simplefilter("ignore")
            env = gym.make(env_id, render_mode="rgb_array")
            env.reset(seed=0)
            env.render()
            env.close()
    except Exception as e:  # a missing GL backend or renderer (pygame), whichever way the env reports it
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        return (f"--capture-video cannot render {env_id} here ({why}): without a display a MuJoCo env needs "
                "MUJOCO_GL=egl or osmesa, a classic-control env pygame")
    return None


def arg_errors(args):
    """This script's checks, in order, after the shared ones: (the input is wrong, a message that names the fix)."""
    for name in ("num_envs", "buffer_size", "batch_size", "policy_frequency"):
        yield getattr(args, name) <= 0, f"{flag(name)} must be positive, got {getattr(args, name)}"
    yield args.save_buffer and not args.save_model, "--save-buffer needs --save-model"
    yield args.learning_starts < 0, f"--learning-starts must be >= 0, got {args.learning_starts}"
    yield args.total_timesteps // args.num_envs <= args.learning_starts // args.num_envs, (
        f"--total-timesteps ({args.total_timesteps}) must be larger than --learning-starts ({args.learning_starts}), "
        "or no update ever runs: raise the budget or lower --learning-starts")
    yield args.batch_size > args.buffer_size, (
        f"--batch-size ({args.batch_size}) is larger than --buffer-size ({args.buffer_size}): lower it or grow the "
        "buffer")
    yield args.buffer_size % args.num_envs != 0, (
        f"--buffer-size ({args.buffer_size}) must be a multiple of --num-envs ({args.num_envs})")
    yield not (0 <= args.gamma <= 1 and 0 <= args.tau <= 1), (  # also false for nan
        f"--gamma ({args.gamma}) and --tau ({args.tau}) must lie in [0, 1]")
    yield not (math.isfinite(args.learning_rate) and args.learning_rate > 0), (
        f"--learning-rate must be a positive number, got {args.learning_rate}")
    for name in ("policy_noise", "exploration_noise", "noise_clip"):
        yield not (math.isfinite(getattr(args, name)) and getattr(args, name) >= 0), (
            f"{flag(name)} must be a non-negative number, got {getattr(args, name)}")
    gl = headless_gl() if args.capture_video else None  # before env_spaces first imports mujoco
    obs_space, act_space = env_spaces(args.env_id)
    yield not isinstance(act_space, gym.spaces.Box), (
        f"TD3 needs a continuous (Box) action space, but {args.env_id} has {act_space}: use DQN or PPO")
    yield not (np.isfinite(act_space.low).all() and np.isfinite(act_space.high).all()), (
        f"TD3 squashes actions into the action bounds, but {args.env_id} has infinite bounds: "
        "wrap it in gymnasium.wrappers.RescaleAction")
    yield not isinstance(obs_space, gym.spaces.Box) or len(obs_space.shape) != 1, (
        f"TD3's MLPs need a flat Box observation space, but {args.env_id} has {obs_space}: "
        "wrap it in gymnasium.wrappers.FlattenObservation")
    if args.capture_video:  # found out now, not when the first video is written, and nothing made before
        folder = "videos" if os.path.lexists("videos") else "."
        yield not (os.path.isdir(folder) and os.access(folder, os.W_OK)), (
            "--capture-video writes to videos/, which cannot be written here: run from a writable folder")
        yield importlib.util.find_spec("moviepy") is None, "--capture-video needs moviepy: pip install moviepy"
        error = render_error(args.env_id)
        yield error is not None, error
        if gl and "mujoco" in sys.modules:
            note(f"note: no display: MuJoCo renders the videos with MUJOCO_GL={gl} (set MUJOCO_GL to choose)")


def main(args: Args) -> dict:
    # SETUP: the arguments checked (a --resume checkpoint's first), torch seeded, the device picked
    run = Run(args, arg_errors)
    args, device = run.args, run.device
    # same-step autoreset puts the true last observation of a finished episode in infos["final_obs"] and
    # returns the reset observation as next_obs, so no stored transition crosses a reset
    envs = gym.vector.SyncVectorEnv(
        [make_env(args.env_id, args.seed + i, i, args.capture_video, run.name) for i in range(args.num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    envs = gym.wrappers.vector.RecordEpisodeStatistics(envs)
    n_obs = math.prod(envs.single_observation_space.shape)
    n_act = math.prod(envs.single_action_space.shape)

    actor = Actor(n_obs, envs.single_action_space, device=device)
    qf1 = QNetwork(n_obs, n_act, device=device)
    qf2 = QNetwork(n_obs, n_act, device=device)
    actor_target = copy.deepcopy(actor)
    # the twin Q-networks as one stacked (2, ...) parameter set, evaluated together under torch.vmap
    qnet_params = from_modules(qf1, qf2, as_module=True)
    qnet_target = qnet_params.data.clone()
    qnet = QNetwork(n_obs, n_act, device="meta")  # a shell without weights, filled by functional_call
    optimizers, (update_critic, update_actor) = make_updates(
        args, actor, qnet, qnet_params, actor_target, qnet_target
    )
    nets = {"actor": actor, "actor_target": actor_target, "qnet_params": qnet_params, "qnet_target": qnet_target}
    # the acting policy: a copy that shares the learner's weights, detached from autograd
    actor_detach = Actor(n_obs, envs.single_action_space, device="meta")
    from_module(actor).data.to_module(actor_detach)
    policy = partial(actor_detach.explore, noise_scale=args.exploration_noise)

    # COMPILE: torch.compile fuses each step's kernels; CudaGraphModule records their launches once and replays
    # them (launch cost dominates at these sizes), after 3 warm-up calls that let compilation finish first
    if args.compile:
        update_critic = torch.compile(update_critic)
        update_actor = torch.compile(update_actor)
        policy = torch.compile(policy)
    if args.cudagraphs:
        update_critic = CudaGraphModule(update_critic, warmup=3)
        update_actor = CudaGraphModule(update_actor, warmup=3)
        policy = CudaGraphModule(policy, warmup=3)

    # REPLAY BUFFER: on the device; with --save-buffer the checkpoint holds it, so a resumed run updates at once
    rb = ReplayBuffer(args.buffer_size, [n_obs, n_act, 1, n_obs, 1], device)
    state = {**nets, **optimizers}
    run.start({**state, "replay_buffer": rb} if args.save_buffer else state, losses=("qf_loss", "actor_loss"))
    num_iterations = args.total_timesteps // args.num_envs
    refill = run.checkpoint is not None and rb.size == 0  # resumed without its buffer
    if refill:
        note("note: the checkpoint holds no replay buffer (--save-buffer): the restored policy refills it for "
             f"--learning-starts ({args.learning_starts}) steps before updates resume")
    first_update = (run.global_step // args.num_envs if refill else 0) + args.learning_starts // args.num_envs
    obs, _ = envs.reset(seed=args.seed + run.global_step)  # a resumed run plays new episodes
    for iteration in run.iterations(num_iterations, args.num_envs, first_update):
        # ACT: uniformly random until learning starts, then the policy plus exploration noise
        if iteration < first_update and not refill:
            actions = envs.action_space.sample()
        else:
            with torch.no_grad():
                actions = policy(torch.as_tensor(obs, dtype=torch.float32, device=device))
            actions = actions.cpu().numpy()

        # STEP
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        if "episode" in infos:
            run.episodes_done(infos["episode"]["r"][infos["_episode"]])

        # STORE
        rb.add(transition_rows(obs, actions, rewards, next_obs, terminations, infos))
        obs = next_obs

        # UPDATE
        if iteration >= first_update:
            data = rb.sample(args.batch_size)
            run.log(qf_loss=update_critic(*data))
            if iteration % args.policy_frequency == 0:  # delayed actor and target updates
                run.log(actor_loss=update_actor(data[0]))

    # LOG: the final checkpoint and evaluation, the summary
    envs.close()
    return run.finish(lambda: evaluate(args, actor, device))


# ==================================================================================================================
# PLUMBING: the same in every script under leanrl/, byte for byte (tests/test_meta.py compares them), and none of it
# changes what the algorithm computes: argument checks, checkpoints, signals, and the run record (progress bar,
# metrics.csv, wandb, timing, the JSON summary). A script run as several processes (torchrun) gives its Run a rank
# and a gather (every process's object, in rank order): rank 0 alone writes and speaks, and they agree on stopping.
# ==================================================================================================================

# what a resumed run takes from its own command line; the other arguments come from the checkpoint, but for the
# budget and SAVING_FLAGS where the command line gives them: they belong to the run, unless the resume changes them
SESSION_FLAGS = {"cuda", "track", "wandb_project_name", "wandb_entity", "capture_video", "resume", "eval_episodes",
                 "compile", "cudagraphs", "measure_burnin", "log_every", "backend"}
SAVING_FLAGS = {"save_model", "checkpoint_every", "save_buffer"}
# torch.compile says at every compile that it ignores Optimizer.step's profiler hook: not the user's business
logging.getLogger("torch._dynamo.variables.ctx_manager").addFilter(lambda record: "Profiler" not in str(record.msg))


def note(message):  # on stderr, by one process (under torchrun every process would say the same), above the bar
    if int(os.environ.get("RANK", 0)) == 0:
        tqdm.tqdm.write(message, file=sys.stderr)


def fail(message):  # bad input ends in one line and exit code 2, never in a traceback; every process stops
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # as a finished run leaves it
    note(f"error: {message}")
    sys.exit(2)


def flag(name):
    return "--" + name.replace("_", "-")


def wandb_error():  # wandb asks for a key on a terminal; elsewhere, with none, it ends in a traceback after set-up
    if importlib.util.find_spec("wandb") is None:
        return "--track needs wandb: pip install wandb"
    import netrc
    import urllib.parse

    settings = ""  # where `wandb offline` keeps its mode
    for folder in (os.environ.get("WANDB_CONFIG_DIR") or os.path.expanduser("~/.config/wandb"), "wandb"):
        with contextlib.suppress(OSError):
            settings += open(os.path.join(folder, "settings")).read()
    offline = os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun") or any(
        line.replace(" ", "") in ("mode=offline", "mode=disabled") for line in settings.splitlines())
    terminal = all(stream and stream.isatty() for stream in (sys.stdin, sys.stderr))  # wandb's test for asking
    if offline or terminal or os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    with contextlib.suppress(OSError, netrc.NetrcParseError):  # `wandb login` keeps the key there, for its host
        if any(machine == host or "wandb" in machine for machine in netrc.netrc(os.environ.get("NETRC")).hosts):
            return None
    return ("--track finds no wandb login: run `wandb login`, or set WANDB_MODE=offline to log here and `wandb sync` "
            "later")


def shared_arg_errors(args, checkpoint):
    step, processes = checkpoint["global_step"] if checkpoint else 0, int(os.environ.get("WORLD_SIZE", 1))
    yield args.total_timesteps <= 0, f"--total-timesteps must be positive, got {args.total_timesteps}"
    yield args.total_timesteps < step, (f"--total-timesteps {args.total_timesteps} ends before the checkpoint's "
                                        f"step {step}: give {step} or more (more extends the run)")
    yield not 0 <= args.seed < 2**31, f"--seed must lie in [0, 2**31), got {args.seed}"  # envpool's: int32
    yield args.measure_burnin < 0 or args.log_every <= 0, "--measure-burnin must be >= 0 and --log-every positive"
    yield args.checkpoint_every < 0, f"--checkpoint-every must be >= 0, got {args.checkpoint_every}"
    yield args.checkpoint_every > 0 and not args.save_model, "--checkpoint-every needs --save-model"
    yield (args.eval_episodes or 0) < 0, f"--eval-episodes must be >= 0, got {args.eval_episodes}"
    track_error = wandb_error() if args.track else None
    yield track_error is not None, track_error
    saved = len(checkpoint["rng"]) if checkpoint else processes  # a generator state per process
    yield saved != processes, (f"--resume {args.resume} was written by a run of {saved} processes, not {processes}: "
                               "resume it with as many")


def load_checkpoint(path):
    """A checkpoint that this script wrote, or a one-line error; weights_only: loading runs no code from the file."""
    script = os.path.basename(__file__)
    if not os.path.isfile(path):
        fail(f"--resume {path}: no such file (a run writes runs/<run_name>/checkpoint.pt when given --save-model)")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated by a kill, or not a torch file
        fail(f"--resume {path} is not a readable checkpoint ({type(e).__name__}): resume from an intact one")
    writer = checkpoint.get("script") if isinstance(checkpoint, dict) else None
    if writer != script:
        fail(f"--resume {path} was written by {writer or 'something else'}, not {script}: resume it with that script")
    if "run_name" not in checkpoint:  # an earlier layout
        fail(f"--resume {path} was written by an older {script}: resume it with that version")
    return checkpoint


def resume_args(args, checkpoint):
    """The checkpoint's run arguments with this command line's session flags, and its budget and SAVING_FLAGS where
    it gives them (typed in sys.argv: --name, --name=value or --no-name; a value equal to the default counts)."""
    given = {a.split("=")[0][2:].replace("-", "_").removeprefix("no_") for a in sys.argv[1:] if a.startswith("--")}
    if "save_model" in given and not args.save_model:  # --no-save-model: none of the run's saving flags either
        given |= SAVING_FLAGS
    merged = {}
    for name, value in vars(args).items():
        saved = checkpoint["args"].get(name, value)
        changeable = name in SAVING_FLAGS or name == "total_timesteps"
        merged[name] = value if name in SESSION_FLAGS or (changeable and name in given) else saved
        if name in given and merged[name] != value:
            note(f"note: --resume continues the checkpoint's run: {flag(name)} stays {saved}")
    return Args(**merged)


class Run:
    """The run around the algorithm. Run(args, arg_errors) checks the arguments (a --resume checkpoint's first),
    seeds torch and picks the device; start() restores the checkpoint and opens the record; iterations() drives
    the loop; episodes_done() and log() keep the latest returns and losses; finish() saves, evaluates and writes
    the summary. A resumed run continues in the checkpoint's run folder, its record cut back to the checkpoint's
    step. A file that cannot be written (disk full, folder gone) costs a warning, never the training."""

    def __init__(self, args, arg_errors):
        self.checkpoint = load_checkpoint(args.resume) if args.resume else None
        args = resume_args(args, self.checkpoint) if self.checkpoint else args
        for wrong, message in itertools.chain(shared_arg_errors(args, self.checkpoint), arg_errors(args)):
            if wrong:  # in order: a row may assume that the rows before it hold
                fail(message)
        if args.eval_episodes is None:
            args.eval_episodes = 10 if args.save_model else 0
        torch.manual_seed(args.seed)
        torch.backends.cudnn.deterministic = args.torch_deterministic
        if args.cuda and not torch.cuda.is_available():
            note("note: CUDA is not available, running on the CPU")
        self.device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
        if getattr(args, "cudagraphs", False) and self.device.type != "cuda":
            note("warning: --cudagraphs needs CUDA: running without CUDA graphs")
            args.cudagraphs = False
        self.args, self.rank, self.gather = args, 0, lambda obj: [obj]  # one process
        env = args.env_id.replace(":", "-").replace("/", "-")  # a folder name: module:EnvId, namespace/EnvId
        self.name = f"{env}__{args.exp_name}__{args.seed}__{int(time.time())}"
        self.path = f"runs/{self.name}"
        self.global_step, self.episodes, self.returns = 0, 0, deque(maxlen=10)  # the last 10 finished episodes
        self.finished, self.losses, self.diverged, self.logged_step = [], {}, None, None
        self.saved_step, self.tried_step, self.save_error, self.unwritable = None, None, None, set()
        self.stop_signal, self.stop_time = None, 0.0
        self.resumes, self.wall_before, self.wandb_id = 0, 0.0, None
        if self.checkpoint:
            self.global_step, self.episodes = self.checkpoint["global_step"], self.checkpoint["episodes"]
            self.returns.extend(self.checkpoint["returns"])
            self.resumes, self.wall_before = self.checkpoint["resumes"] + 1, self.checkpoint["wall_seconds"]
            folder = os.path.dirname(args.resume) or "."
            if os.path.basename(os.path.abspath(folder)) == self.checkpoint["run_name"]:
                self.name, self.path, self.wandb_id = self.checkpoint["run_name"], folder, self.checkpoint["wandb_id"]
                # its row ends metrics.csv, and it is this run's checkpoint: saved, and not saved again unless trained
                self.logged_step = self.saved_step = self.tried_step = self.global_step
            else:  # copied elsewhere (its run folder may be gone, or on another machine): a new run, also in wandb
                note(f"note: {args.resume} is not in its run folder, runs/{self.checkpoint['run_name']}: the run "
                     f"continues in {self.path}")

    def start(self, state, losses, checked=None):
        """Copies the checkpoint into `state` (name: a tensor, or anything with state_dict and load_state_dict) in
        place, so that optimisers and CUDA graphs keep the tensors they hold; opens metrics.csv and wandb. A
        non-finite value of a `checked` loss (default: all of `losses`) is a divergence."""
        self.state, self.checked = state, set(losses if checked is None else checked)
        if self.checkpoint:
            with torch.no_grad():
                for name, obj in state.items():
                    if name not in self.checkpoint["state"]:  # saved without it (a replay buffer): starts afresh
                        continue
                    if isinstance(obj, torch.Tensor):
                        obj.copy_(self.checkpoint["state"][name])
                    else:
                        capturable = [group.get("capturable") for group in getattr(obj, "param_groups", [])]
                        obj.load_state_dict(self.checkpoint["state"][name])
                        for group, value in zip(getattr(obj, "param_groups", []), capturable):
                            group["capturable"] = value  # this run's --cudagraphs, not the saved run's
            rng = self.checkpoint["rng"][self.rank]
            torch.set_rng_state(rng["torch"])
            if rng["cuda"] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
            self.checkpoint["state"] = None  # restored: no second copy of a large buffer held for the whole run
        self.metrics_file, crash_step = open(os.devnull, "w"), 0
        if self.rank == 0:
            try:
                os.makedirs(self.path, exist_ok=True)
                if self.checkpoint:
                    crash_step = self.cut_metrics(f"{self.path}/metrics.csv")
                # a resumed run's appended to, line by line: a kill loses no row
                self.metrics_file = open(f"{self.path}/metrics.csv", "a" if self.checkpoint else "w", newline="",
                                         buffering=1)
            except OSError as e:
                self.cannot_write(f"{self.path}/metrics.csv", e)
        fields = ["global_step", "wall_seconds", "episodic_return", "sps", *losses]
        self.metrics = csv.DictWriter(self.metrics_file, fields, lineterminator="\n")
        if self.metrics_file.tell() == 0:
            self.write_metrics(dict(zip(fields, fields)))  # the header
        self.wandb, self.wandb_logged = None, 0  # the last step that the wandb run has
        if self.args.track and self.rank == 0:
            import wandb  # only when asked for: no account or network needed otherwise

            self.wandb = wandb
            wandb.init(project=self.args.wandb_project_name, entity=self.args.wandb_entity, config=vars(self.args),
                       name=self.name, save_code=True, id=self.wandb_id, resume="allow" if self.wandb_id else None)
            if self.wandb_id:  # rewinding a wandb run is a preview feature: no step is logged twice instead
                self.wandb_logged = max(crash_step, getattr(wandb.run, "step", 0))  # run.step: known online only
            if self.wandb_logged > self.global_step:
                note(f"note: wandb run {self.wandb_id} continues; its steps {self.global_step + 1}-{self.wandb_logged} "
                     "keep the values logged before the crash")
            self.wandb_id = wandb.run.id

    def cut_metrics(self, path):
        """Cuts metrics.csv back to the checkpoint's step: the later rows are work that the crash lost. Returns the
        last step cut, or 0."""
        if not os.path.exists(path):
            return 0
        with open(path, "rb+") as f:
            lines = f.readlines()
            # a row that a kill cut short has no line end: None
            steps = [int(line.split(b",")[0]) if line.endswith(b"\n") and line.split(b",")[0].isdigit() else None
                     for line in lines[1:]]
            kept = len(list(itertools.takewhile(lambda s: s is not None and s <= self.global_step, steps)))
            f.truncate(sum(map(len, lines[: 1 + kept])))
        return max(filter(None, steps[kept:]), default=0)

    def iterations(self, num_iterations, steps_per_iteration, first_update):
        """The iterations left to train. After each: the losses are read (a host-device sync) every --log-every, at
        the end, before a checkpoint and at a stop; the periodic checkpoint; the end of the loop at a non-finite
        loss or a signal (Ctrl-C or SIGTERM lets the iteration finish, a second one stops at once), which every
        process learns of at the end of the iteration. Iterations from first_update on are burn-in (compile,
        warm-up) for --measure-burnin, then steady state (sps); compile_seconds counts the burn-in and the first
        --measure-burnin iterations, where an acting policy used from the first step compiles."""
        args, saved_step = self.args, self.global_step
        every = args.checkpoint_every if args.save_model else 0
        first = self.global_step // steps_per_iteration
        first_update = max(first_update, first)  # a resumed run's may be past
        steady_from = min(first_update + args.measure_burnin, num_iterations)
        self.start_time, self.steady_start, self.steady_step, self.compile_seconds = time.perf_counter(), None, 0, 0.0
        handlers = {s: signal.signal(s, self.request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        self.bar = tqdm.tqdm(range(first, num_iterations), file=sys.stderr, mininterval=1.0, disable=self.rank != 0)
        try:
            for iteration in self.bar:
                if iteration == steady_from:
                    self.steady_start, self.steady_step = time.perf_counter(), self.global_step
                tick = time.perf_counter()
                self.global_step += steps_per_iteration
                yield iteration
                if iteration < steady_from and (iteration >= first_update or iteration < first + args.measure_burnin):
                    self.compile_seconds += time.perf_counter() - tick
                for returns, signum in self.gather((self.finished, self.stop_signal)):  # every process's
                    self.returns.extend(returns)
                    self.episodes += len(returns)
                    self.stop_signal = self.stop_signal or signum
                self.finished = []
                due = every > 0 and self.global_step // every > saved_step // every
                stopping = self.stop_signal is not None  # read once: a later signal stops the next iteration
                if iteration % args.log_every == 0 or iteration == num_iterations - 1 or due or stopping:
                    self.write_row()
                if self.diverged or stopping:  # never a checkpoint of diverged weights
                    break
                if due:
                    error = self.save()
                    if error and not self.save_error:  # once: the next periodic saves try again, silently
                        note(f"warning: {error}: training goes on, and the next save tries again")
                    self.save_error, saved_step = error, self.global_step
        finally:
            self.end_time = time.perf_counter()
            self.bar.close()
            for s, handler in handlers.items():
                signal.signal(s, handler)

    def request_stop(self, signum, frame):  # a repeat within a second is the same request: under torchrun a
        # process may get a signal twice, from torchrun, which passes it on, and from the terminal or the scheduler
        if self.stop_signal is None:
            self.stop_signal, self.stop_time = signum, time.monotonic()
        elif time.monotonic() - self.stop_time > 1.0:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def episodes_done(self, returns):  # counted at the end of the iteration, with the other processes' episodes
        self.finished.extend(map(float, returns))

    def log(self, **losses):  # the latest losses (numbers or device tensors): read at the log points
        self.losses.update((name, value) for name, value in losses.items() if value is not None)

    def write_row(self):
        now, logs = time.perf_counter(), {"episodic_return": float(np.mean(self.returns)) if self.returns else None}
        steady = self.steady_start is not None and self.global_step > self.steady_step
        logs["sps"] = (self.global_step - self.steady_step) / (now - self.steady_start) if steady else None
        logs.update((name, float(value)) for name, value in self.losses.items())  # the host-device sync
        diverged = next(((k, logs[k]) for k in self.losses if k in self.checked and not math.isfinite(logs[k])), None)
        self.diverged = next((d for d in self.gather(diverged) if d), None)  # in any process: all of them stop
        self.bar.set_postfix({k: f"{v:.4g}" for k, v in logs.items() if v is not None}, refresh=False)
        row = {"wall_seconds": round(self.wall_before + now - self.start_time, 3), **logs}
        self.write_metrics({"global_step": self.global_step, **row})
        if self.wandb and self.global_step > self.wandb_logged:  # metrics.csv's row; its global_step is wandb's step
            self.wandb.log({k: v for k, v in row.items() if v is not None}, step=self.global_step)
        self.logged_step = self.global_step

    def write_metrics(self, row):
        try:
            self.metrics.writerow(row)
        except OSError as e:
            self.cannot_write(f"{self.path}/metrics.csv", e)

    def cannot_write(self, path, error):  # once a file: a record that cannot be written never ends the training
        if path not in self.unwritable:
            self.unwritable.add(path)
            note(f"warning: cannot write {path} ({error}): the run goes on without it")

    def save(self):
        """Writes the checkpoint beside the last one, then renames it over it: a kill mid-write leaves the last one
        whole. Returns None, or the error (disk full, folder gone) that left the last one in place."""
        rng = self.gather({"torch": torch.get_rng_state(),  # every process's generators
                           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []})
        self.tried_step, path = self.global_step, f"{self.path}/checkpoint.pt"  # tried by every process, in step
        if self.rank != 0:
            return None
        try:
            with open(f"{path}.tmp", "wb") as f:  # through a Python file, a write fails with the OS's reason
                torch.save({"script": os.path.basename(__file__), "args": dataclasses.asdict(self.args),
                            "run_name": self.name, "global_step": self.global_step, "episodes": self.episodes,
                            "returns": list(self.returns), "rng": rng, "resumes": self.resumes,
                            "wall_seconds": self.wall_before + time.perf_counter() - self.start_time,
                            "wandb_id": self.wandb_id,
                            "state": {k: v.detach() if isinstance(v, torch.Tensor) else v.state_dict()
                                      for k, v in self.state.items()}}, f)
            os.replace(f"{path}.tmp", path)
        except (OSError, RuntimeError) as e:
            reason = e if isinstance(e, OSError) else e.__context__  # torch's zip writer raises over the OS's error
            if not isinstance(reason, OSError):
                raise
            with contextlib.suppress(OSError):
                os.remove(f"{path}.tmp")
            return f"cannot write {path} ({reason})"
        self.saved_step = self.global_step
        return None

    def finish(self, evaluate, **extra):
        """The final checkpoint (none of diverged weights), the evaluation of the final policy (also after a stop,
        never after a divergence), and the summary (with `extra`'s keys): the last line on stdout and summary.json.
        wall_seconds is the training loop's time over all resumes, without evaluation. exit_code: 0, 1 diverged or
        the final checkpoint not written, 128 + a signal."""
        args, end, steady_start, steady_step = self.args, self.end_time, self.steady_start, self.steady_step
        if self.logged_step != self.global_step:  # a finished run resumed anew: its curve ends at its last step
            self.write_row()
        with contextlib.suppress(OSError):  # said at the write that failed
            self.metrics_file.close()
        final_error = None
        if self.diverged:
            where = f"the last checkpoint, {self.path}/checkpoint.pt, is intact" if self.saved_step else \
                "no checkpoint was saved"
            note(f"error: {self.diverged[0]} is {self.diverged[1]} at global step {self.global_step}: the run "
                 f"diverged; {where}")
        elif args.save_model:  # unless the last periodic save was at this step
            final_error = self.save() if self.tried_step != self.global_step else self.save_error
            if final_error:
                where = "the last periodic one is intact" if self.saved_step else "no checkpoint was saved"
                note(f"error: {final_error}: the final checkpoint is lost, {where}")
        summary = {
            "script": os.path.basename(__file__), "env_id": args.env_id, "seed": args.seed,
            "compile": getattr(args, "compile", False), "cudagraphs": getattr(args, "cudagraphs", False),
            "device": str(self.device), "torch": torch.__version__, "global_step": self.global_step,
            "wall_seconds": round(self.wall_before + end - self.start_time, 3),
            "compile_seconds": round(self.compile_seconds, 3),
            "sps": round((self.global_step - steady_step) / (end - steady_start), 2)
            if steady_start and self.global_step > steady_step else None,
            "episodic_return": float(np.mean(self.returns)) if self.returns and np.isfinite(self.returns).all()
            else None,
            "episodes": self.episodes, **extra,
            "losses": {k: float(v) if math.isfinite(float(v)) else None for k, v in self.losses.items()},  # not NaN
            "run_name": self.name,
            "checkpoint": f"{self.path}/checkpoint.pt" if self.saved_step and not final_error else None,
            "eval_return": evaluate() if args.eval_episodes > 0 and not self.diverged else None,
            "eval_episodes": args.eval_episodes, "interrupted": self.stop_signal is not None,
            "diverged": self.diverged is not None, "resumed_from": args.resume, "resumes": self.resumes,
            "checkpoint_error": final_error,
            "exit_code": 1 if self.diverged or final_error else 128 + self.stop_signal if self.stop_signal else 0,
        }
        if self.rank != 0:  # rank 0 alone says how the run ended: torchrun stops every process once one fails
            return {**summary, "exit_code": 0}
        try:
            with open(f"{self.path}/summary.json", "w") as f:
                json.dump(summary, f)
        except OSError as e:
            self.cannot_write(f"{self.path}/summary.json", e)
        if self.wandb:
            self.wandb.summary.update(summary)
            self.wandb.finish()
        print(json.dumps(summary), flush=True)
        return summary


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Args))["exit_code"])
