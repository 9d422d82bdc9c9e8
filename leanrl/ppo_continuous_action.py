"""Proximal Policy Optimization (PPO) for continuous actions: the plain eager PyTorch script.

Schulman et al., "Proximal Policy Optimization Algorithms", 2017, https://arxiv.org/abs/1707.06347
A Gaussian policy with a state-independent log-std, the clipped surrogate objective, GAE, value
clipping, per-minibatch advantage normalisation, an entropy bonus, learning-rate annealing, optional
`--target-kl` early stopping, and observation / reward normalisation with clipping, with CleanRL's
hyper-parameters. The compiled twin, ppo_continuous_action_torchcompile.py, computes the same with GAE as a
log-depth scan, the minibatch update as one graph (torch.func.grad and Adam written out), torch.compile and CUDA
graphs: `diff` the two files to see what compiling takes.

    python leanrl/ppo_continuous_action.py --env-id HalfCheetah-v5 --total-timesteps 1000000
"""

import contextlib
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
from typing import Optional

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import tqdm
import tyro


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
    resume: Optional[str] = None
    """a checkpoint.pt to continue: its env, seed and hyper-parameters; a larger --total-timesteps extends the run"""
    eval_episodes: Optional[int] = None
    """episodes of the Gaussian's mean after training (training env 0's frozen normalisation); default 10 with
    --save-model, else 0"""

    # Algorithm specific arguments
    env_id: str = "HalfCheetah-v5"
    """the id of the environment"""
    total_timesteps: int = 1_000_000
    """total timesteps of the experiments (rounded down to whole rollouts of num_envs * num_steps)"""
    learning_rate: float = 3e-4
    """the learning rate of the optimizer"""
    num_envs: int = 1
    """the number of parallel game environments"""
    num_steps: int = 2048
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """toggle learning rate annealing to 0 at the last rollout (re-planned over a budget that --resume extends)"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 32
    """the number of mini-batches"""
    update_epochs: int = 10
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """toggles advantages normalization"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """toggles whether or not to use a clipped loss for the value function, as per the paper"""
    ent_coef: float = 0.0
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    target_kl: Optional[float] = None
    """the target KL divergence threshold: an iteration stops its epochs once the last minibatch's exceeds it"""

    # Performance
    measure_burnin: int = 3
    """iterations left out of the steady-state sps: compiling happens in the first, GAE's CUDA graph in the third"""
    log_every: int = 1
    """iterations between two reads of the losses (each read synchronises host and device)"""


def make_env(env_id, idx, capture_video, run_name, gamma):
    def thunk():
        if capture_video and idx == 0:
            env = gym.make(env_id, render_mode="rgb_array")
            env = gym.wrappers.RecordVideo(env, f"videos/{run_name}")
        else:
            env = gym.make(env_id)
        env = gym.wrappers.FlattenObservation(env)
        env = gym.wrappers.RecordEpisodeStatistics(env)  # before the normalisation: the real returns
        env = gym.wrappers.ClipAction(env)  # the Gaussian's samples are unbounded; the stored action is not clipped
        env = gym.wrappers.NormalizeObservation(env)
        # gymnasium 1.x: TransformObservation takes the new observation space as a third argument
        clipped = gym.spaces.Box(-10.0, 10.0, env.observation_space.shape, np.float32)
        env = gym.wrappers.TransformObservation(env, lambda obs: obs.clip(-10, 10), clipped)
        env = gym.wrappers.NormalizeReward(env, gamma=gamma)
        env = gym.wrappers.TransformReward(env, lambda reward: np.clip(reward, -10, 10))
        return env

    return thunk


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, n_obs, n_act, device=None):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(n_obs, 64, device=device)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64, device=device)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 1, device=device), std=1.0),
        )
        self.actor_mean = nn.Sequential(
            layer_init(nn.Linear(n_obs, 64, device=device)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64, device=device)),
            nn.Tanh(),
            layer_init(nn.Linear(64, n_act, device=device), std=0.01),
        )
        self.actor_logstd = nn.Parameter(torch.zeros(1, n_act, device=device))

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        """Samples an action (or scores the given one); returns (action, log_prob, entropy, value).
        The Gaussian's log-density and entropy are written out: torch.distributions.Normal checks its
        arguments on every call, which costs more than the maths at these sizes."""
        action_mean = self.actor_mean(x)
        action_logstd = self.actor_logstd.expand_as(action_mean)
        action_std = action_logstd.exp()
        if action is None:
            action = action_mean + action_std * torch.randn_like(action_mean)
        log_prob = -0.5 * ((action - action_mean) / action_std).pow(2) - action_logstd - 0.5 * math.log(2 * math.pi)
        entropy = 0.5 + 0.5 * math.log(2 * math.pi) + action_logstd
        return action, log_prob.sum(1), entropy.sum(1), self.critic(x)


class Normalization:
    """The running statistics of each env's NormalizeObservation and NormalizeReward, as a checkpoint entry:
    without them a restored policy would see observations scaled otherwise than in training."""

    def __init__(self, envs):
        self.wrappers = []
        for env in envs.envs:
            found = {}
            while isinstance(env, gym.Wrapper):  # down the env's chain of wrappers
                found[type(env)] = env
                env = env.env
            self.wrappers.append((found[gym.wrappers.NormalizeObservation], found[gym.wrappers.NormalizeReward]))

    def state_dict(self):
        """Per env, float64 tensors: "obs_rms" (mean, var, count), "return_rms" (mean, var, count, discounted)."""
        def f64(*xs):
            return [torch.tensor(np.asarray(x, dtype=np.float64)) for x in xs]

        return {"obs_rms": [f64(o.obs_rms.mean, o.obs_rms.var, o.obs_rms.count) for o, _ in self.wrappers],
                "return_rms": [f64(r.return_rms.mean, r.return_rms.var, r.return_rms.count, r.discounted_reward)
                               for _, r in self.wrappers]}

    def load_state_dict(self, stats):
        for (o, r), (mean, var, count), (r_mean, r_var, r_count, discounted) in zip(
            self.wrappers, stats["obs_rms"], stats["return_rms"]
        ):
            o.obs_rms.mean, o.obs_rms.var, o.obs_rms.count = mean.numpy(), var.numpy(), count.item()
            r.return_rms.mean, r.return_rms.var, r.return_rms.count = r_mean.numpy(), r_var.numpy(), r_count.item()
            r.discounted_reward = discounted.numpy()


def finished_episodes(infos):
    """(return, length) of each episode that ended in this vector step. With same-step autoreset the
    info of an env's last step sits in infos["final_info"] (its reset's info is in infos)."""
    final = infos.get("final_info", {})
    if "episode" not in final:
        return []
    done = final["_episode"]
    return list(zip(final["episode"]["r"][done].tolist(), final["episode"]["l"][done].tolist()))


def truncation_bootstrap(rewards, terminations, truncations, infos, get_value, gamma):
    """Returns the rewards with gamma * V(last observation) added where an episode was truncated.

    A time limit is not a terminal state: the return goes on past it, so the truncated step is worth
    r + gamma * V(s_last) (Pardo et al., "Time Limits in Reinforcement Learning", 2018; SB3 does this).
    The step then counts as done in GAE, so nothing is bootstrapped from the next episode's reset
    observation. CleanRL treats a truncation as a termination (V = 0), which biases every value
    near the limit, the more so in HalfCheetah, whose episodes all end by truncation."""
    truncated = truncations & ~terminations
    if not truncated.any():
        return rewards
    last_obs = np.stack(infos["final_obs"][truncated])  # same-step autoreset: the true last observations
    rewards = rewards.copy()
    rewards[truncated] += gamma * get_value(last_obs)
    return rewards


def compute_gae(next_value, next_done, rewards, values, dones, gamma, gae_lambda):
    """Generalised advantage estimation over a rollout, all (num_steps, num_envs); returns
    (advantages, returns). dones[t] says that obs[t] began a new episode."""
    next_values = torch.cat([values[1:], next_value[None]])  # V(s_{t+1})
    next_nonterminal = 1.0 - torch.cat([dones[1:], next_done[None]])
    deltas = rewards + gamma * next_values * next_nonterminal - values
    coefs = gamma * gae_lambda * next_nonterminal
    # A[t] = delta[t] + coef[t] * A[t+1], from the last step back
    advantages = torch.zeros_like(rewards)
    lastgaelam = torch.zeros_like(rewards[0])
    for t in reversed(range(len(rewards))):
        advantages[t] = lastgaelam = deltas[t] + coefs[t] * lastgaelam
    return advantages, advantages + values


def make_update(args, agent):
    """Builds the minibatch update, a function over tensors on the device with no host synchronisation;
    returns (update, set_learning_rate, the optimiser: its state_dict and load_state_dict for checkpoints)."""
    # fused: one kernel per parameter for Adam's update instead of a loop of small ones
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=True)

    def set_learning_rate(lr):
        optimizer.param_groups[0]["lr"] = lr

    def loss_fn(obs, actions, logprobs, advantages, returns, values):
        _, newlogprob, entropy, newvalue = agent.get_action_and_value(obs, actions)
        logratio = newlogprob - logprobs
        ratio = logratio.exp()
        with torch.no_grad():
            # calculate approx_kl http://joschu.net/blog/kl-approx.html
            old_approx_kl = (-logratio).mean()
            approx_kl = ((ratio - 1) - logratio).mean()
            clipfrac = ((ratio - 1.0).abs() > args.clip_coef).float().mean()
        if args.norm_adv:
            advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)

        # Policy loss
        pg_loss1 = -advantages * ratio
        pg_loss2 = -advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
        pg_loss = torch.max(pg_loss1, pg_loss2).mean()

        # Value loss
        newvalue = newvalue.view(-1)
        if args.clip_vloss:
            v_loss_unclipped = (newvalue - returns) ** 2
            v_clipped = values + torch.clamp(newvalue - values, -args.clip_coef, args.clip_coef)
            v_loss_clipped = (v_clipped - returns) ** 2
            v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
        else:
            v_loss = 0.5 * ((newvalue - returns) ** 2).mean()

        entropy_loss = entropy.mean()
        loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef
        return loss, (pg_loss.detach(), v_loss.detach(), entropy_loss.detach(), old_approx_kl, approx_kl, clipfrac)

    def update(obs, actions, logprobs, advantages, returns, values):
        """One gradient step on a minibatch; returns (pg_loss, v_loss, entropy, old_approx_kl, approx_kl, clipfrac)."""
        loss, stats = loss_fn(obs, actions, logprobs, advantages, returns, values)
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
        optimizer.step()
        return stats

    return update, set_learning_rate, optimizer


@torch.no_grad()
def evaluate(args, agent, obs_rms, device):
    """The mean raw return of --eval-episodes episodes of the Gaussian's mean (clipped to the action bounds by
    ClipAction), in a fresh env seeded seed + 100_000 + i. Observations are normalised and clipped as in
    training, with training env 0's statistics frozen: obs_rms is its (mean, var, count)."""
    env = gym.wrappers.ClipAction(gym.wrappers.FlattenObservation(gym.make(args.env_id)))
    mean, var, _ = (x.numpy() for x in obs_rms)
    returns = []
    for i in range(args.eval_episodes):
        obs, _ = env.reset(seed=args.seed + 100_000 + i)
        returns.append(0.0)
        done = False
        while not done:
            obs = np.float32((obs - mean) / np.sqrt(var + 1e-8)).clip(-10, 10)  # NormalizeObservation's epsilon
            action = agent.actor_mean(torch.as_tensor(obs, device=device)[None])[0]
            obs, reward, terminated, truncated, _ = env.step(action.cpu().numpy())
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
    for name in ("num_envs", "num_steps", "num_minibatches", "update_epochs"):
        yield getattr(args, name) <= 0, f"{flag(name)} must be positive, got {getattr(args, name)}"
    batch_size = args.num_envs * args.num_steps
    yield args.total_timesteps < batch_size, (
        f"--total-timesteps ({args.total_timesteps}) is smaller than one rollout of --num-envs * --num-steps "
        f"({batch_size}) steps, so no update ever runs: raise the budget or lower --num-steps")
    yield batch_size % args.num_minibatches != 0, (
        f"the batch of --num-envs * --num-steps = {batch_size} steps does not split into --num-minibatches "
        f"({args.num_minibatches}) equal minibatches: pick a divisor of {batch_size}")
    yield args.norm_adv and batch_size // args.num_minibatches < 2, (
        "advantage normalisation needs minibatches of at least 2 steps: lower --num-minibatches or pass --no-norm-adv")
    yield not (0 <= args.gamma <= 1 and 0 <= args.gae_lambda <= 1), (  # also false for nan
        f"--gamma ({args.gamma}) and --gae-lambda ({args.gae_lambda}) must lie in [0, 1]")
    for name in ("learning_rate", "clip_coef", "max_grad_norm"):
        yield not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0), (
            f"{flag(name)} must be a positive number, got {getattr(args, name)}")
    for name in ("ent_coef", "vf_coef"):
        yield not (math.isfinite(getattr(args, name)) and getattr(args, name) >= 0), (
            f"{flag(name)} must be a non-negative number, got {getattr(args, name)}")
    yield args.target_kl is not None and not (math.isfinite(args.target_kl) and args.target_kl > 0), (
        f"--target-kl must be a positive number, got {args.target_kl}")
    gl = headless_gl() if args.capture_video else None  # before env_spaces first imports mujoco
    obs_space, act_space = env_spaces(args.env_id)
    yield not isinstance(act_space, gym.spaces.Box), (
        f"this PPO samples continuous (Box) actions, but {args.env_id} has {act_space}: pass an env with Box "
        "actions, such as HalfCheetah-v5")
    try:
        gym.spaces.flatdim(obs_space)
    except (NotImplementedError, ValueError):
        yield True, f"PPO's MLPs need an observation space that flattens to a vector, but {args.env_id} has {obs_space}"
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
    batch_size = args.num_envs * args.num_steps
    minibatch_size = batch_size // args.num_minibatches
    num_iterations = args.total_timesteps // batch_size
    # same-step autoreset puts the true last observation of a finished episode in infos["final_obs"], which the
    # truncation bootstrap needs; the wrappers run inside each env
    envs = gym.vector.SyncVectorEnv(
        [make_env(args.env_id, i, args.capture_video, run.name, args.gamma) for i in range(args.num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    n_obs = math.prod(envs.single_observation_space.shape)
    n_act = math.prod(envs.single_action_space.shape)
    normalization = Normalization(envs)

    agent = Agent(n_obs, n_act, device=device)
    update, set_learning_rate, optimizer = make_update(args, agent)

    def get_value(obs):  # the critic on numpy observations, for the truncation bootstrap
        with torch.no_grad():
            return agent.get_value(torch.as_tensor(obs, dtype=torch.float32, device=device)).view(-1).cpu().numpy()

    next_obs, _ = envs.reset(seed=args.seed + run.global_step)  # a resumed run starts new episodes
    # after the reset, whose observations would otherwise count in the restored statistics. Only the losses count
    # as a divergence: the explained variance is nan when the returns are constant
    run.start({"agent": agent, "optimizer": optimizer, "normalization": normalization}, losses=(
        "learning_rate", "value_loss", "policy_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac",
        "explained_variance"), checked=("value_loss", "policy_loss", "entropy"))
    next_obs = torch.as_tensor(next_obs, dtype=torch.float32, device=device)
    next_done = np.zeros(args.num_envs, dtype=bool)
    gradient_steps = 0
    start_iteration = run.global_step // batch_size
    for iteration in run.iterations(num_iterations, batch_size, first_update=start_iteration):
        # linearly from --learning-rate down to (almost) 0 with --anneal-lr
        lrnow = (1.0 - iteration / num_iterations) * args.learning_rate if args.anneal_lr else args.learning_rate
        set_learning_rate(lrnow)

        # COLLECT TRAJECTORIES: a list per quantity, one entry per step, stacked once per rollout
        # (appending costs less than writing into preallocated storage, an indexing call per step)
        obs, actions, logprobs, rewards, dones, values = [], [], [], [], [], []
        for step in range(args.num_steps):
            obs.append(next_obs)
            dones.append(next_done)
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
            values.append(value)
            actions.append(action)
            logprobs.append(logprob)

            next_obs, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
            rewards.append(truncation_bootstrap(reward, terminations, truncations, infos, get_value, args.gamma))
            # on a CPU this shares the array envs.step returned, a new one each step (SyncVectorEnv copies)
            next_obs = torch.as_tensor(next_obs, dtype=torch.float32, device=device)
            next_done = terminations | truncations
            run.episodes_done([episodic_return for episodic_return, _ in finished_episodes(infos)])

        # (num_steps, num_envs, ...) tensors on the device
        obs, actions, logprobs = torch.stack(obs), torch.stack(actions), torch.stack(logprobs)
        values = torch.stack(values).view(args.num_steps, args.num_envs)
        rewards = torch.as_tensor(np.stack(rewards), dtype=torch.float32, device=device)
        dones = torch.as_tensor(np.stack(dones), dtype=torch.float32, device=device)

        # CALCULATE ADVANTAGE
        with torch.no_grad():
            next_value = agent.get_value(next_obs).view(-1)
            next_done_t = torch.as_tensor(next_done, dtype=torch.float32, device=device)
            advantages, returns = compute_gae(next_value, next_done_t, rewards, values, dones, args.gamma,
                                              args.gae_lambda)

        # flatten the batch
        b_obs, b_actions = obs.reshape(-1, n_obs), actions.reshape(-1, n_act)
        b_logprobs, b_advantages, b_returns, b_values = (x.reshape(-1) for x in (logprobs, advantages, returns, values))

        # OPTIMIZE: update_epochs passes over the batch in shuffled minibatches. Each epoch gathers the
        # batch once in a random order and cuts it into consecutive minibatches (views, no copies)
        clipfracs = []
        for epoch in range(args.update_epochs):
            b_inds = torch.randperm(batch_size, device=device)
            batch = (b_obs, b_actions, b_logprobs, b_advantages, b_returns, b_values)
            for minibatch in zip(*(x[b_inds].split(minibatch_size) for x in batch)):
                pg_loss, v_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac = update(*minibatch)
                clipfracs.append(clipfrac)
                gradient_steps += 1
            # CleanRL's rule: after a whole epoch, stop if the last minibatch's KL estimate is past the target
            if args.target_kl is not None and approx_kl.item() > args.target_kl:
                break

        # LOG: device tensors, read at the log points
        explained_var = 1 - (b_returns - b_values).var() / b_returns.var()  # nan when the returns are constant
        run.log(learning_rate=lrnow, value_loss=v_loss, policy_loss=pg_loss, entropy=entropy_loss,
                old_approx_kl=old_approx_kl, approx_kl=approx_kl, clipfrac=torch.stack(clipfracs).mean(),
                explained_variance=explained_var)

    summary = run.finish(lambda: evaluate(args, agent, normalization.state_dict()["obs_rms"][0], device),
                         gradient_steps=gradient_steps)
    envs.close()
    return summary


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
