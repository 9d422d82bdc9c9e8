"""Proximal Policy Optimization (PPO) on Atari with envpool: the torch.compile / CUDA-graph twin.

Schulman et al., "Proximal Policy Optimization Algorithms", 2017, https://arxiv.org/abs/1707.06347
The Nature CNN (Mnih et al., 2015) with a categorical policy head and a value head, the clipped surrogate
objective, GAE, value clipping, per-minibatch advantage normalisation, an entropy bonus, learning-rate annealing
and optional `--target-kl` early stopping, with CleanRL's hyper-parameters, on envpool's C++ Atari with the
standard settings (84x84 grey frames, 4 stacked, 4 frames skipped, up to 30 no-ops at reset, FIRE at reset, a
lost life ends the learner's episode, rewards clipped to their sign). The compiled twin,
ppo_atari_envpool_torchcompile.py, computes the same with GAE as a log-depth scan, the minibatch update as one
graph, torch.compile and CUDA graphs: `diff` the two files to see what compiling takes. Needs
requirements/requirements-atari.txt.

    python leanrl/ppo_atari_envpool_torchcompile.py --compile --cudagraphs
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
from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
import tqdm
import tyro
from tensordict import from_module
from tensordict.nn import CudaGraphModule

try:
    import envpool
except ImportError:  # a one-line error from arg_errors, not a traceback
    envpool = None


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
    save_model: bool = False
    """whether to save a checkpoint (weights, optimiser, RNG, step, args) to runs/{run_name}/checkpoint.pt"""
    checkpoint_every: int = 0
    """with --save-model, also save the checkpoint every this many steps (0: only at the end)"""
    resume: Optional[str] = None
    """a checkpoint.pt to continue: its env, seed and hyper-parameters; a larger --total-timesteps extends the run.
    Its envs start new games: the scores of the games in progress when it was saved are not counted"""
    eval_episodes: Optional[int] = None
    """whole games (all lives, raw score) of argmax actions after training, one in each of this many envs; default
    10 with --save-model, else 0. A policy that never presses FIRE plays on to the 27,000-step limit"""

    # Algorithm specific arguments
    env_id: str = "Breakout-v5"
    """the id of the envpool Atari game (envpool's `-v5` ids)"""
    total_timesteps: int = 10_000_000
    """total timesteps of the experiments (rounded down to whole rollouts of num_envs * num_steps)"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 8
    """the number of parallel game environments"""
    num_steps: int = 128
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """toggle learning rate annealing to 0 at the last rollout (re-planned over a budget that --resume extends)"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 4
    """the number of mini-batches"""
    update_epochs: int = 4
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """toggles advantages normalization"""
    clip_coef: float = 0.1
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """toggles whether or not to use a clipped loss for the value function, as per the paper"""
    ent_coef: float = 0.01
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    target_kl: Optional[float] = None
    """the target KL divergence threshold: an iteration stops its epochs once the last minibatch's exceeds it"""

    # Performance
    compile: bool = False
    """whether to compile the policy, GAE and the update with torch.compile"""
    cudagraphs: bool = False
    """whether to replay the policy, GAE and the update as CUDA graphs (CUDA only: a CPU warns and runs without)"""
    measure_burnin: int = 3
    """iterations left out of the steady-state sps: compiling happens in the first, GAE's CUDA graph in the third"""
    log_every: int = 1
    """iterations between two reads of the losses (each read synchronises host and device)"""


def make_envs(env_id, num_envs, seed):
    """num_envs games stepped together in envpool's C++ threads, the settings of CleanRL's ppo_atari_envpool.py:
    frame skip 4, 84x84 grey frames stacked 4 deep (uint8), up to 30 no-ops and FIRE (in the games that have it)
    at reset, 27,000 steps at most, a lost life reported as a termination (the game goes on) and rewards clipped
    to their sign. infos["reward"] keeps the unclipped reward and infos["terminated"] says that the game is over."""
    return envpool.make(env_id, env_type="gymnasium", num_envs=num_envs, episodic_life=True, reward_clip=True,
                        seed=seed)


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, n_act, device=None):
        super().__init__()
        # the Nature CNN: (N, 4, 84, 84) -> (N, 512)
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4, device=device)),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2, device=device)),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1, device=device)),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512, device=device)),
            nn.ReLU(),
        )
        self.actor = layer_init(nn.Linear(512, n_act, device=device), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1, device=device), std=1)

    def get_value(self, x):
        return self.critic(self.network(x / 255.0))

    def get_action_and_value(self, x, action=None):
        """x: uint8 frames (N, 4, 84, 84), scaled to [0, 1] here so that they travel as bytes. Samples an action
        (or scores the given one); returns (action, log_prob, entropy, value). The categorical distribution is
        written out: torch.distributions.Categorical checks its arguments on every call, which costs more than
        the maths at these sizes."""
        hidden = self.network(x / 255.0)
        logits = self.actor(hidden)
        log_probs = logits.log_softmax(-1)
        if action is None:
            # Gumbel-max: the argmax of the logits plus Gumbel noise is a sample of softmax(logits)
            action = (logits - torch.rand_like(logits).log().neg().log()).argmax(-1)
        log_prob = log_probs.gather(-1, action[..., None]).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        return action, log_prob, entropy, self.critic(hidden)

    def forward(self, x, action=None):  # what torch.func.functional_call runs
        return self.get_action_and_value(x, action)


class GameStatistics:
    """The score of whole games, summed from the unclipped rewards over all their lives.

    With episodic life, `terminations` fires at every lost life, so summing rewards between those would report
    one life's clipped score. A game ends at game over (infos["terminated"]) or at the time limit
    (`truncations`): both reset the count. After every learner's episode end (lost life included) envpool spends
    one step resetting, which ignores the action, pays nothing and leaves infos["elapsed_step"] alone, so a
    game's length is its elapsed_step when it ends."""

    def __init__(self, num_envs):
        self.returns = np.zeros(num_envs)

    def update(self, truncations, infos):
        """Counts one step; returns (return, length) of each game that ended in it."""
        self.returns += infos["reward"]
        game_over = infos["terminated"].astype(bool) | truncations
        finished = list(zip(self.returns[game_over].tolist(), infos["elapsed_step"][game_over].tolist()))
        self.returns[game_over] = 0.0
        return finished


def compute_gae(next_value, next_done, rewards, values, dones, gamma, gae_lambda):
    """Generalised advantage estimation over a rollout, all (num_steps, num_envs); returns
    (advantages, returns). dones[t] says that obs[t] began a new episode."""
    next_values = torch.cat([values[1:], next_value[None]])  # V(s_{t+1})
    next_nonterminal = 1.0 - torch.cat([dones[1:], next_done[None]])
    deltas = rewards + gamma * next_values * next_nonterminal - values
    coefs = gamma * gae_lambda * next_nonterminal
    # A[t] = delta[t] + coef[t] * A[t+1], from the last step back, as a Hillis-Steele scan: after the
    # round with shift s, advantages[t] sums the terms t .. t+2s-1 and coefs[t] is their discount, so
    # log2(num_steps) vectorised rounds replace the num_steps-long loop that torch.compile would unroll
    advantages, shift = deltas, 1
    while shift < len(rewards):
        advantages = advantages + coefs * torch.cat([advantages[shift:], torch.zeros_like(advantages[:shift])])
        coefs = coefs * torch.cat([coefs[shift:], torch.zeros_like(coefs[:shift])])
        shift *= 2
    return advantages, advantages + values


def make_update(args, agent):
    """Builds the minibatch update, a function over tensors on the device with no host synchronisation;
    returns (update, set_learning_rate, the optimiser: its state_dict and load_state_dict for checkpoints)."""
    # it compiles into one graph: torch.func.grad replaces loss.backward() and Adam's arithmetic optimizer.step(), where
    # torch.compile would split it (each split a pass over the weights and a return to Python)
    params = dict(agent.named_parameters())  # the learner's weights, updated in place
    weights = list(params.values())
    # torch.optim.Adam's state (eps=1e-5 as in CleanRL); lr is a tensor set in place, as a float would be compiled in
    lr = torch.tensor(args.learning_rate, device=weights[0].device)
    beta1, beta2, eps = 0.9, 0.999, 1e-5
    step = torch.zeros((), device=weights[0].device)
    exp_avgs = [torch.zeros_like(w) for w in weights]
    exp_avg_sqs = [torch.zeros_like(w) for w in weights]

    def set_learning_rate(value):
        lr.fill_(value)

    # the optimiser's state for checkpoints, loaded in place: compiled code and CUDA graphs read these very tensors
    optimizer = SimpleNamespace(
        state_dict=lambda: {"step": step, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs},
        load_state_dict=lambda state: torch._foreach_copy_([step, *exp_avgs, *exp_avg_sqs],
                                                           [state["step"], *state["exp_avgs"], *state["exp_avg_sqs"]]))

    def loss_fn(params, obs, actions, logprobs, advantages, returns, values):
        _, newlogprob, entropy, newvalue = torch.func.functional_call(agent, params, (obs, actions))
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
        minibatch = (obs, actions, logprobs, advantages, returns, values)
        grads, stats = torch.func.grad(loss_fn, has_aux=True)(params, *minibatch)
        grads = list(grads.values())
        with torch.no_grad():
            # nn.utils.clip_grad_norm_, on the gradients in hand
            total_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
            torch._foreach_mul_(grads, (args.max_grad_norm / (total_norm + 1e-6)).clamp(max=1.0))
            # torch.optim.Adam's step (no weight decay, no amsgrad)
            step.add_(1)
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
            denom = torch._foreach_div(torch._foreach_sqrt(exp_avg_sqs), (1 - beta2**step).sqrt())
            torch._foreach_add_(denom, eps)
            updates = torch._foreach_div(exp_avgs, denom)
            torch._foreach_mul_(updates, lr / (1 - beta1**step))
            torch._foreach_sub_(weights, updates)
        return stats

    return update, set_learning_rate, optimizer


@torch.no_grad()
def evaluate(args, agent, device, memory_format):
    """The mean raw score of --eval-episodes whole games of argmax actions, one in each of --eval-episodes envs
    stepped together, with every life and unclipped rewards (episodic_life=False, reward_clip=False), seeded apart
    from training. Each env's first game counts; the envs that finish early wait for the others."""
    envs = envpool.make(args.env_id, env_type="gymnasium", num_envs=args.eval_episodes, episodic_life=False,
                        reward_clip=False, seed=(args.seed + 100_000) % 2**31)
    scores = np.full(args.eval_episodes, np.nan)  # each env's first game, nan while it plays
    returns = np.zeros(args.eval_episodes)
    obs, _ = envs.reset()
    while np.isnan(scores).any():
        x = torch.as_tensor(obs, device=device).contiguous(memory_format=memory_format)
        action = agent.actor(agent.network(x / 255.0)).argmax(-1)
        obs, reward, terminations, truncations, _ = envs.step(action.cpu().numpy())
        returns += reward
        first_end = (terminations | truncations) & np.isnan(scores)
        scores[first_end] = returns[first_end]
    envs.close()
    return float(scores.mean())


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
    yield envpool is None, "this script needs envpool: pip install -r requirements/requirements-atari.txt"
    yield ":" in args.env_id, (f"--env-id {args.env_id}: this script takes envpool's Atari games (Breakout-v5, "
                               "Pong-v5...), not gymnasium's module:EnvId; for an env of your own use "
                               "ppo_continuous_action.py (continuous actions) or dqn.py (discrete)")
    specs = envpool.registration.registry.specs  # envpool also registers MuJoCo, classic control, Procgen...
    games = sorted(name for name, (module, *_) in specs.items() if module == "envpool.atari")
    close = difflib.get_close_matches(args.env_id, games, n=3)
    yield args.env_id not in games, f"{args.env_id!r} is not an envpool Atari game: " + (
        f"did you mean {', '.join(close)}?" if close else "pick an Atari game such as Breakout-v5 or Pong-v5")


def main(args: Args) -> dict:
    # SETUP: the arguments checked (a --resume checkpoint's first), torch seeded, the device picked
    run = Run(args, arg_errors)
    args, device = run.args, run.device
    batch_size = args.num_envs * args.num_steps
    minibatch_size = batch_size // args.num_minibatches
    num_iterations = args.total_timesteps // batch_size
    # envpool resets a finished env on its next step (which ignores the action). Its seed is fixed at creation: a
    # resumed run seeds its new games with the step it resumes from
    envs = make_envs(args.env_id, args.num_envs, (args.seed + run.global_step) % 2**31)
    obs_shape = envs.single_observation_space.shape  # (4, 84, 84), uint8
    games = GameStatistics(args.num_envs)

    # on a CPU, oneDNN's convolutions run about 1.5x faster on channels-last (NHWC) weights and frames; each step's
    # frames take that layout as they arrive, and stacking, gathering and splitting the rollout keep it
    memory_format = torch.channels_last if device.type == "cpu" else torch.contiguous_format
    agent = Agent(envs.single_action_space.n, device=device).to(memory_format=memory_format)
    update, set_learning_rate, optimizer = make_update(args, agent)
    # the acting policy: a copy that shares the learner's weights, detached from autograd
    agent_inference = Agent(envs.single_action_space.n, device="meta")  # a shell without weights, filled by to_module
    from_module(agent).data.to_module(agent_inference)
    policy = agent_inference.get_action_and_value
    gae = compute_gae

    # COMPILE: torch.compile fuses each step's kernels; CudaGraphModule records their launches once and replays
    # them (launch cost dominates at these sizes), after 3 warm-up calls that let compilation finish first
    if args.compile:
        # on a CPU, inductor's C++ wrapper (in place of its Python one) saves about 20 us a call
        policy = torch.compile(policy, options={"cpp_wrapper": device.type == "cpu"})
        gae = torch.compile(gae)
        update = torch.compile(update)
    if args.cudagraphs:
        policy = CudaGraphModule(policy, warmup=3)
        gae = CudaGraphModule(gae, warmup=3)
        update = CudaGraphModule(update, warmup=3)

    # Only the losses count as a divergence: the explained variance is nan when the returns are constant
    run.start({"agent": agent, "optimizer": optimizer}, losses=(
        "learning_rate", "value_loss", "policy_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac",
        "explained_variance"), checked=("value_loss", "policy_loss", "entropy"))
    next_obs, _ = envs.reset()
    # frames travel as uint8, a quarter of float32's bytes: one copy to the device per step
    next_obs = torch.as_tensor(next_obs, device=device).contiguous(memory_format=memory_format)
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
                action, logprob, _, value = policy(next_obs)
            values.append(value)
            actions.append(action)
            logprobs.append(logprob)

            next_obs, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
            rewards.append(reward)
            next_obs = torch.as_tensor(next_obs, device=device).contiguous(memory_format=memory_format)
            # a lost life ends the learner's episode, as in CleanRL; so does the time limit (rare in Atari: 27,000
            # steps), without the bootstrap the continuous PPO adds
            next_done = terminations | truncations
            run.episodes_done([score for score, _ in games.update(truncations, infos)])

        # (num_steps, num_envs, ...) tensors on the device
        obs, actions, logprobs = torch.stack(obs), torch.stack(actions), torch.stack(logprobs)
        values = torch.stack(values).view(args.num_steps, args.num_envs)
        rewards = torch.as_tensor(np.stack(rewards), dtype=torch.float32, device=device)
        dones = torch.as_tensor(np.stack(dones), dtype=torch.float32, device=device)

        # CALCULATE ADVANTAGE
        with torch.no_grad():
            next_value = agent.get_value(next_obs).view(-1)
            next_done_t = torch.as_tensor(next_done, dtype=torch.float32, device=device)
            advantages, returns = gae(next_value, next_done_t, rewards, values, dones, args.gamma, args.gae_lambda)

        # flatten the batch
        b_obs, b_actions = obs.reshape(-1, *obs_shape), actions.reshape(-1)
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

    summary = run.finish(lambda: evaluate(args, agent, device, memory_format), gradient_steps=gradient_steps)
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
