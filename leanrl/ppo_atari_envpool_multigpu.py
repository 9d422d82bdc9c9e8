"""Proximal Policy Optimization (PPO) on Atari with envpool, data-parallel over processes (GPUs or
machines) with torch.distributed: the plain eager PyTorch script.

Schulman et al., "Proximal Policy Optimization Algorithms", 2017, https://arxiv.org/abs/1707.06347
The Nature CNN (Mnih et al., 2015) with a categorical policy head and a value head, the clipped
surrogate objective, GAE, value clipping, per-minibatch advantage normalisation, an entropy bonus,
learning-rate annealing and optional `--target-kl` early stopping, with CleanRL's hyper-parameters,
on envpool's C++ Atari with the standard settings (84x84 grey frames, 4 stacked, 4 frames skipped,
up to 30 no-ops at reset, FIRE at reset, a lost life ends the learner's episode, rewards clipped
to their sign). It is ppo_atari_envpool.py run by several processes (`diff` the two files to see
what scaling out takes): each process steps its own --local-num-envs envs with its own seeds and
collects its own rollout; every minibatch, the processes average their gradients with one
all-reduce, so that every process takes the same Adam step and the weights stay identical (rank 0
broadcasts its initial weights). Rank 0 alone logs, checkpoints and evaluates. The compiled twin is
ppo_atari_envpool_multigpu_torchcompile.py. Needs requirements/requirements-atari.txt.

    torchrun --standalone --nproc_per_node 2 leanrl/ppo_atari_envpool_multigpu.py --local-num-envs 4

On several machines: the same command on each, with --nnodes N --rdzv-backend c10d --rdzv-endpoint
HOST:29500 --rdzv-id RUN in place of --standalone (README, "Scaling out"). Without torchrun it runs
as one process.
"""

import csv
import dataclasses
import difflib
import hashlib
import json
import math
import os
import random
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

# before any process group exists (torch.optim and torch.compile would import it later): torch._dynamo
# imports torch.distributed.nn.functional, whose functions take the default process group as a
# default argument. Bound after init_process_group, they would keep the group, and its gloo threads,
# alive past destroy_process_group, and a gloo thread still releasing the last collective's tensors
# while the interpreter shuts down aborts the process at exit ("terminate called without an active
# exception", SIGABRT)
import torch._dynamo  # noqa: F401
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
    """if toggled, cuda will be used when available (the script falls back to the CPU with a note); each process takes the GPU of its LOCAL_RANK"""
    backend: Optional[str] = None
    """the torch.distributed backend (default: nccl on CUDA, gloo on the CPU)"""
    track: bool = False
    """if toggled, this experiment will be tracked with Weights and Biases (honours WANDB_MODE)"""
    wandb_project_name: str = "leanrl"
    """the wandb's project name"""
    wandb_entity: Optional[str] = None
    """the entity (team) of wandb's project"""
    save_model: bool = False
    """whether to save a checkpoint (weights, optimiser state, RNG states, step, args) to runs/{run_name}/checkpoint.pt at the end"""
    checkpoint_every: int = 0
    """with --save-model, also save the checkpoint every this many steps (0: only at the end)"""
    resume: Optional[str] = None
    """a checkpoint.pt to continue from to its own --total-timesteps (env, seed, budget and hyper-parameters come from the checkpoint);
    its envs start new games, and the scores of the games in progress when it was saved are not counted"""
    eval_episodes: Optional[int] = None
    """episodes to evaluate the final policy deterministically (mean action / argmax) after training; default 10 with --save-model, else 0.
    Here: argmax actions, one whole game (all its lives, raw score) in each of --eval-episodes envs in parallel.
    A policy that never presses FIRE (Breakout after a lost life) plays on until the 27,000-step limit"""

    # Algorithm specific arguments
    env_id: str = "Breakout-v5"
    """the id of the envpool Atari game (envpool's `-v5` ids)"""
    total_timesteps: int = 10_000_000
    """total timesteps of the experiments, all processes together (rounded down to whole rollouts of local_num_envs * num_steps * processes)"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    local_num_envs: int = 8
    """the number of parallel game environments in each process (the run steps local_num_envs * processes games)"""
    num_steps: int = 128
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """toggle learning rate annealing for policy and value networks"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 4
    """the number of mini-batches each process cuts its rollout into (one all-reduce of the gradients each)"""
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
    """the target KL divergence threshold: an iteration stops its epochs once the mean over the processes of their last minibatch's exceeds it"""

    # Performance
    measure_burnin: int = 2
    """iterations (rollout + update) left out of the steady-state sps: compiling happens in the first,
    and GAE's CUDA graph, called once an iteration, is captured in the second"""


# what a resumed run takes from its command line; the rest (env, seed, budget, hyper-parameters) comes from the checkpoint
SESSION_FLAGS = {"cuda", "track", "wandb_project_name", "wandb_entity", "capture_video", "save_model", "checkpoint_every", "resume", "eval_episodes", "backend", "compile", "cudagraphs", "measure_burnin", "log_every"}


def note(message: str):
    """A line on stderr from rank 0 only: torchrun shows every process's output, and all of them would say the same."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(message, file=sys.stderr)


def fail(message: str):
    """Stops with a one-line message and exit code 2: bad input never ends in a traceback. Every
    process stops (they all check the same input); rank 0 says why. A process that has joined the
    group leaves it first, as a finished run does (see the import of torch._dynamo)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    note(f"error: {message}")
    sys.exit(2)


def save_checkpoint(path, checkpoint):
    """Writes to a temporary file beside `path`, then renames it over `path`: the rename is atomic, so
    a kill mid-write leaves the previous checkpoint whole."""
    torch.save(checkpoint, path + ".tmp")
    os.replace(path + ".tmp", path)


def load_checkpoint(path):
    """Reads a checkpoint that this script wrote; anything else ends in a one-line error. weights_only:
    tensors, numbers and strings only, so loading runs no code from the file."""
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
    return checkpoint


def resume_args(args, checkpoint):
    """The checkpoint's run arguments, with this command line's session flags."""
    saved = checkpoint["args"]
    for name, value in vars(args).items():
        if name not in SESSION_FLAGS and name in saved and value != saved[name] and value != getattr(Args, name, None):
            note(f"note: --resume continues the checkpoint's run: --{name.replace('_', '-')} stays {saved[name]}")
    return Args(**{name: value if name in SESSION_FLAGS or name not in saved else saved[name] for name, value in vars(args).items()})


def rng_states():
    """Python's, numpy's and torch's generators, in types that torch.load(weights_only=True) reads."""
    np_state = np.random.get_state(legacy=False)
    return {
        "python": random.getstate(),
        "numpy": (torch.from_numpy(np_state["state"]["key"].astype(np.int64)), np_state["state"]["pos"], np_state["has_gauss"], np_state["gauss"]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_states(states):
    random.setstate(states["python"])
    key, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state(("MT19937", key.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def atari_games():
    """envpool's Atari ids (envpool also registers MuJoCo, classic control, Procgen...)."""
    from envpool.registration import registry

    return sorted(env_id for env_id, (module, *_) in registry.specs.items() if module == "envpool.atari")


def check_args(args: Args, world_size: int):
    for name in ("total_timesteps", "local_num_envs", "num_steps", "num_minibatches", "update_epochs"):
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0 <= args.seed < 2**31:  # envpool's seed is an int32
        fail(f"--seed must lie in [0, 2**31), got {args.seed}")
    batch_size = args.local_num_envs * args.num_steps  # each process's rollout
    if args.total_timesteps < batch_size * world_size:
        fail(
            f"--total-timesteps ({args.total_timesteps}) is smaller than one rollout of --local-num-envs * --num-steps * "
            f"{world_size} processes ({batch_size * world_size}) steps, so no update ever runs: raise the budget or lower --num-steps"
        )
    if batch_size % args.num_minibatches:
        fail(
            f"the batch of --local-num-envs * --num-steps = {batch_size} steps does not split into --num-minibatches "
            f"({args.num_minibatches}) equal minibatches: pick a divisor of {batch_size}"
        )
    if args.norm_adv and batch_size // args.num_minibatches < 2:
        fail("advantage normalisation needs minibatches of at least 2 steps: lower --num-minibatches or pass --no-norm-adv")
    if not (0.0 <= args.gamma <= 1.0 and 0.0 <= args.gae_lambda <= 1.0):  # also false for nan
        fail(f"--gamma ({args.gamma}) and --gae-lambda ({args.gae_lambda}) must lie in [0, 1]")
    for name in ("learning_rate", "clip_coef", "max_grad_norm"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0):
            fail(f"--{name.replace('_', '-')} must be a positive number, got {getattr(args, name)}")
    for name in ("ent_coef", "vf_coef"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) >= 0):
            fail(f"--{name.replace('_', '-')} must be a non-negative number, got {getattr(args, name)}")
    if args.target_kl is not None and not (math.isfinite(args.target_kl) and args.target_kl > 0):
        fail(f"--target-kl must be a positive number, got {args.target_kl}")
    if args.measure_burnin < 0:
        fail(f"--measure-burnin must be >= 0, got {args.measure_burnin}")
    if args.checkpoint_every < 0:
        fail(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    if args.checkpoint_every > 0 and not args.save_model:
        fail("--checkpoint-every needs --save-model")
    if args.eval_episodes is not None and args.eval_episodes < 0:
        fail(f"--eval-episodes must be >= 0, got {args.eval_episodes}")
    if args.backend is not None and args.backend not in ("gloo", "nccl"):
        fail(f"--backend {args.backend!r} is not a torch.distributed backend: pick gloo (CPU or CUDA) or nccl (CUDA)")
    try:
        import envpool  # noqa: F401
    except ImportError:
        fail("this script needs envpool: pip install -r requirements/requirements-atari.txt")
    games = atari_games()
    if args.env_id not in games:
        close = difflib.get_close_matches(args.env_id, games, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else "pick an Atari game such as Breakout-v5 or Pong-v5"
        fail(f"{args.env_id!r} is not an envpool Atari game: {hint}")


def init_distributed(args: Args):
    """Joins the process group that torchrun describes in its environment (RANK, WORLD_SIZE,
    MASTER_ADDR, ...), or, run without torchrun, forms a group of one process, so that the same code
    runs either way. Returns (rank, world_size, device): each process takes the GPU of its LOCAL_RANK."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() and args.cuda else torch.device("cpu")
    backend = args.backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        fail("--backend nccl needs CUDA: on the CPU use --backend gloo (the default there)")
    if not dist.is_backend_available(backend):
        fail(f"--backend {backend} is not built into this torch: pick gloo (CPU or CUDA) or nccl (CUDA)")
    if device.type == "cuda" and local_rank >= torch.cuda.device_count():
        fail(f"this process has LOCAL_RANK {local_rank}, but the machine has {torch.cuda.device_count()} GPUs: launch at most that many processes per machine (--nproc_per_node)")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.cuda and not torch.cuda.is_available():
        note("note: CUDA is not available, running on the CPU")
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size(), device


def all_gather(obj, world_size):
    """Every process's `obj` (anything picklable), in rank order, on every process."""
    objects = [None] * world_size
    dist.all_gather_object(objects, obj)
    return objects


def make_envs(env_id, num_envs, seed):
    """num_envs games stepped together in envpool's C++ threads, the settings of CleanRL's
    ppo_atari_envpool.py: frame skip 4, 84x84 grey frames stacked 4 deep (uint8), up to 30 no-ops and
    FIRE (in the games that have it) at reset, 27,000 steps at most, a lost life reported as a
    termination (the game goes on) and rewards clipped to their sign. infos["reward"] keeps the
    unclipped reward and infos["terminated"] says that the game itself is over."""
    import envpool

    return envpool.make(env_id, env_type="gymnasium", num_envs=num_envs, episodic_life=True, reward_clip=True, seed=seed)


class GameStatistics:
    """The score of whole games, summed from the unclipped rewards over all their lives.

    With episodic life, `terminations` fires at every lost life, so summing rewards between those
    would report one life's clipped score. A game ends at game over (infos["terminated"]) or at the
    time limit (`truncations`): both reset the count. After every learner's episode end (lost life
    included) envpool spends one step resetting, which ignores the action, pays nothing and leaves
    infos["elapsed_step"] alone, so a game's length is its elapsed_step when it ends."""

    def __init__(self, num_envs):
        self.returns = np.zeros(num_envs)

    def update(self, truncations, infos):
        """Counts one step; returns (return, length) of each game that ended in it."""
        self.returns += infos["reward"]
        game_over = infos["terminated"].astype(bool) | truncations
        finished = list(zip(self.returns[game_over].tolist(), infos["elapsed_step"][game_over].tolist()))
        self.returns[game_over] = 0.0
        return finished


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
        """x: uint8 frames (N, 4, 84, 84), scaled to [0, 1] here so that they travel as bytes.
        Samples an action (or scores the given one); returns (action, log_prob, entropy, value).
        The categorical distribution is written out: torch.distributions.Categorical checks its
        arguments on every call, which costs more than the maths at these sizes."""
        hidden = self.network(x / 255.0)
        logits = self.actor(hidden)
        log_probs = logits.log_softmax(-1)
        if action is None:
            # Gumbel-max: the argmax of the logits plus Gumbel noise is a sample of softmax(logits)
            action = (logits - torch.rand_like(logits).log().neg().log()).argmax(-1)
        log_prob = log_probs.gather(-1, action[..., None]).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        return action, log_prob, entropy, self.critic(hidden)


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


def make_update(args, agent, world_size):
    """Builds the minibatch update as two functions over tensors on the device with no host
    synchronisation, the halves before and after the all-reduce of the gradients: compute_grads and
    apply_grads; a setter for the learning rate, and a getter and an in-place setter of the
    optimiser's state for checkpoints. Returns (compute_grads, apply_grads, set_learning_rate,
    optimizer_state, load_optimizer_state)."""
    params = list(agent.parameters())
    # fused: one kernel per parameter for Adam's update instead of a loop of small ones
    optimizer = torch.optim.Adam(params, lr=args.learning_rate, eps=1e-5, fused=True)

    def set_learning_rate(lr):
        optimizer.param_groups[0]["lr"] = lr

    def optimizer_state():
        return optimizer.state_dict()

    def load_optimizer_state(state):
        optimizer.load_state_dict(state)
        # Adam's moments in their weights' memory format: fused Adam pairs elements in memory order, and a
        # checkpoint from another device has that device's layout (channels-last on a CPU only)
        for p in agent.parameters():
            optimizer.state[p].update({k: torch.empty_like(p).copy_(v) for k, v in optimizer.state[p].items() if v.shape == p.shape})

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

    def compute_grads(obs, actions, logprobs, advantages, returns, values):
        """This process's gradients on its minibatch, flattened into one vector that one all-reduce moves;
        returns (grads, (pg_loss, v_loss, entropy, old_approx_kl, approx_kl, clipfrac))."""
        loss, stats = loss_fn(obs, actions, logprobs, advantages, returns, values)
        optimizer.zero_grad()
        loss.backward()
        return torch.cat([p.grad.reshape(-1) for p in params]), stats

    def apply_grads(grads):
        """grads: the sum of every process's flat gradients. Their mean, clipped, takes Adam's step."""
        for p, g in zip(params, (grads / world_size).split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))
        nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        optimizer.step()

    return compute_grads, apply_grads, set_learning_rate, optimizer_state, load_optimizer_state


def evaluate(args, state_dict, n_act, device, memory_format):
    """The mean raw score of --eval-episodes whole games played by a fresh copy of the policy with
    argmax actions: one game in each of --eval-episodes envs stepped together, with every life and
    unclipped rewards (episodic_life=False, reward_clip=False), seeded apart from training. Each env's
    first game counts; the envs that finish early wait for the others. A policy that never presses
    FIRE (Breakout after a lost life) plays on until the 27,000-step limit."""
    import envpool

    envs = envpool.make(args.env_id, env_type="gymnasium", num_envs=args.eval_episodes, episodic_life=False, reward_clip=False, seed=(args.seed + 100_000) % 2**31)
    agent = Agent(n_act, device=device).to(memory_format=memory_format)
    agent.load_state_dict(state_dict)
    scores = np.full(args.eval_episodes, np.nan)  # each env's first game, nan while it plays
    returns = np.zeros(args.eval_episodes)
    obs, _ = envs.reset()
    while np.isnan(scores).any():
        with torch.no_grad():
            x = torch.as_tensor(obs, device=device).contiguous(memory_format=memory_format)
            action = agent.actor(agent.network(x / 255.0)).argmax(-1)
        obs, reward, terminations, truncations, _ = envs.step(action.cpu().numpy())
        returns += reward
        first_end = (terminations | truncations) & np.isnan(scores)
        scores[first_end] = returns[first_end]
    envs.close()
    return float(scores.mean())


def main(args: Args) -> dict:
    # torchrun's; without torchrun (no RANK) a lone process. The input is checked before the processes meet
    world_size = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ else 1
    checkpoint = load_checkpoint(args.resume) if args.resume else None
    if checkpoint is not None:
        args = resume_args(args, checkpoint)
        if checkpoint["world_size"] != world_size:
            fail(f"--resume {args.resume} was written by a run of {checkpoint['world_size']} processes, not {world_size}: resume it with as many, each with --local-num-envs {args.local_num_envs}")
    check_args(args, world_size)
    if args.eval_episodes is None:
        args.eval_episodes = 10 if args.save_model else 0
    local_batch_size = args.local_num_envs * args.num_steps  # each process's rollout
    batch_size = local_batch_size * world_size  # the steps of one iteration, all processes together
    minibatch_size = local_batch_size // args.num_minibatches
    num_iterations = args.total_timesteps // batch_size
    run_name = f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
    checkpoint_path = f"runs/{run_name}/checkpoint.pt"

    # PROCESSES, SEEDING AND DEVICE: each process seeds its own generators (its sampled actions and
    # minibatches differ from the others'); the initial weights are rank 0's, broadcast below
    rank, world_size, device = init_distributed(args)
    # every process must run the same command (on several machines, each machine its own): another
    # budget, schedule or --save-model would leave some processes waiting in a collective that the
    # others never call, another seed or env would silently train something else
    launch = {k: v for k, v in vars(args).items() if k not in ("resume", "track", "wandb_project_name", "wandb_entity")}
    launch["resume"] = checkpoint["global_step"] if checkpoint is not None else None  # the path may differ between machines
    differing = sorted({k for other in all_gather(launch, world_size) for k in launch if other[k] != launch[k]})
    if differing:
        fail(f"the processes were launched with different {', '.join('--' + k.replace('_', '-') for k in differing)}: give every machine the same command")
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    wandb = None
    if args.track and rank == 0:
        import wandb  # only imported when asked for: no account or network needed otherwise

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=vars(args), name=run_name, save_code=True)

    # ENVIRONMENTS: envpool resets a finished env on its next step (which ignores the action). Its seed
    # is fixed at creation: a resumed run seeds new games with the step it resumes from (an int32).
    # envpool seeds its env i with seed + i, so each process's envs get seeds of their own
    global_step = checkpoint["global_step"] if checkpoint is not None else 0
    envs = make_envs(args.env_id, args.local_num_envs, (args.seed + rank * args.local_num_envs + global_step) % 2**31)
    obs_shape = envs.single_observation_space.shape  # (4, 84, 84), uint8
    n_act = envs.single_action_space.n

    # AGENT: on a CPU, oneDNN's convolutions run about 1.5x faster on channels-last (NHWC) weights and
    # frames; each step's frames take that layout as they arrive, and stacking, gathering and
    # splitting the rollout keep it
    memory_format = torch.channels_last if device.type == "cpu" else torch.contiguous_format
    agent = Agent(n_act, device=device).to(memory_format=memory_format)
    for p in agent.parameters():  # every process starts from rank 0's weights
        weights = p.data.contiguous()  # gloo sends contiguous tensors only, not the CPU's channels-last ones
        dist.broadcast(weights, src=0)
        p.data.copy_(weights)
    compute_grads, apply_grads, set_learning_rate, optimizer_state, load_optimizer_state = make_update(args, agent, world_size)

    # RESUME: in place (load_state_dict copies into the existing tensors, which keep their memory
    # format), so the update holds the restored weights and state. The scores of the games that were in
    # progress are not saved: the resumed run starts new games
    episodes, returns_window = 0, deque(maxlen=10)  # the whole-game scores of the last 10 finished games
    if checkpoint is not None:
        agent.load_state_dict(checkpoint["model"]["agent"])
        load_optimizer_state(checkpoint["optimizer"]["optimizer"])
        episodes = checkpoint["episodes"]
        returns_window.extend(checkpoint["returns"])
        set_rng_states(checkpoint["rng"][rank])

    def save():
        """The checkpoint, from the uncompiled module (its state_dict's names carry no compile wrapper's
        prefix), written by rank 0 with every process's generators: every process calls it."""
        rngs = all_gather(rng_states(), world_size)
        if rank != 0:
            return
        save_checkpoint(checkpoint_path, {
            "script": os.path.basename(__file__),
            "args": dataclasses.asdict(args),
            "global_step": global_step,
            "episodes": episodes,
            "returns": list(returns_window),
            "world_size": world_size,
            "rng": rngs,
            "model": {"agent": agent.state_dict()},
            "optimizer": {"optimizer": optimizer_state()},
        })

    def update(*minibatch):
        """One gradient step, the same in every process: this process's gradients, summed over the
        processes by one all-reduce (every process receives the same bytes), then averaged, clipped and
        applied. Returns this process's (pg_loss, v_loss, entropy, old_approx_kl, approx_kl, clipfrac)."""
        grads, stats = compute_grads(*minibatch)
        dist.all_reduce(grads)  # in place; a sum (gloo has no mean) that apply_grads divides
        apply_grads(grads)
        return stats

    # CURVE: every logged point also goes to runs/<run_name>/metrics.csv (line-buffered, an empty
    # cell where there is no value yet), so that curves can be plotted without wandb; rank 0 writes it,
    # the other processes write to os.devnull
    if rank == 0:
        os.makedirs(f"runs/{run_name}", exist_ok=True)
    metrics_file = open(f"runs/{run_name}/metrics.csv" if rank == 0 else os.devnull, "w", newline="", buffering=1)
    metrics = csv.DictWriter(metrics_file, ["global_step", "wall_seconds", "episodic_return", "sps", "learning_rate", "value_loss", "policy_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac", "explained_variance"], lineterminator="\n")
    metrics.writeheader()

    # TRAINING LOOP
    games = GameStatistics(args.local_num_envs)
    start_iteration = global_step // batch_size  # a resumed run's annealing goes on from there
    gradient_steps, last_saved, saved, diverged = 0, global_step, False, False
    losses = {}
    start_time = time.perf_counter()
    steady_start, steady_step = None, 0
    next_obs, _ = envs.reset()
    # frames travel as uint8, a quarter of float32's bytes: one copy to the device per step
    next_obs = torch.as_tensor(next_obs, device=device).contiguous(memory_format=memory_format)
    next_done = np.zeros(args.local_num_envs, dtype=bool)

    # STOPPING: Ctrl-C (SIGINT) or SIGTERM lets the current iteration finish, then the run checkpoints
    # (with --save-model) and summarises; a second signal stops at once. torchrun passes a signal that it
    # receives on to every process, which may also get its own copy (a scheduler that signals them all,
    # or a Ctrl-C where torchrun keeps its processes in the terminal's group): a repeat within a second
    # counts once. The processes agree on stopping at the end of each iteration
    stop_signal, stop_time, stopping = None, None, None

    def request_stop(signum, frame):
        nonlocal stop_signal, stop_time
        if stop_signal is None:
            stop_signal, stop_time = signum, time.monotonic()
        elif time.monotonic() - stop_time > 1.0:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    previous_handlers = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    pbar = tqdm.tqdm(range(start_iteration, num_iterations), file=sys.stderr, mininterval=1.0, disable=rank != 0)
    for iteration in pbar:
        if iteration == start_iteration + args.measure_burnin:
            steady_start, steady_step = time.perf_counter(), global_step
        # linearly from --learning-rate down to (almost) 0 with --anneal-lr
        lrnow = (1.0 - iteration / num_iterations) * args.learning_rate if args.anneal_lr else args.learning_rate
        set_learning_rate(lrnow)

        # COLLECT TRAJECTORIES: a list per quantity, one entry per step, stacked once per rollout
        # (appending costs less than writing into preallocated storage, an indexing call per step)
        obs, actions, logprobs, rewards, dones, values = [], [], [], [], [], []
        finished = []  # the whole-game scores of this process's games that end in this rollout
        for step in range(args.num_steps):
            global_step += args.local_num_envs * world_size
            obs.append(next_obs)
            dones.append(next_done)
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
            values.append(value)
            actions.append(action)
            logprobs.append(logprob)

            next_obs, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
            rewards.append(reward)
            next_obs = torch.as_tensor(next_obs, device=device).contiguous(memory_format=memory_format)
            # a lost life ends the learner's episode, as in CleanRL; so does the time limit (rare in
            # Atari: 27,000 steps), without the bootstrap the continuous PPO adds
            next_done = terminations | truncations
            finished += [episodic_return for episodic_return, _ in games.update(truncations, infos)]

        # (num_steps, num_envs, ...) tensors on the device
        obs, actions, logprobs = torch.stack(obs), torch.stack(actions), torch.stack(logprobs)
        values = torch.stack(values).view(args.num_steps, args.local_num_envs)
        rewards = torch.as_tensor(np.stack(rewards), dtype=torch.float32, device=device)
        dones = torch.as_tensor(np.stack(dones), dtype=torch.float32, device=device)

        # CALCULATE ADVANTAGE
        with torch.no_grad():
            next_value = agent.get_value(next_obs).view(-1)
            next_done_t = torch.as_tensor(next_done, dtype=torch.float32, device=device)
            advantages, returns = compute_gae(next_value, next_done_t, rewards, values, dones, args.gamma, args.gae_lambda)

        # flatten the batch
        b_obs = obs.reshape(-1, *obs_shape)
        b_actions = actions.reshape(-1)
        b_logprobs = logprobs.reshape(-1)
        b_advantages = advantages.reshape(-1)
        b_returns = returns.reshape(-1)
        b_values = values.reshape(-1)

        # OPTIMIZE: update_epochs passes over the batch in shuffled minibatches. Each epoch gathers the
        # batch once in a random order and cuts it into consecutive minibatches (views, no copies)
        clipfracs = []
        for epoch in range(args.update_epochs):
            b_inds = torch.randperm(local_batch_size, device=device)
            batch = (b_obs, b_actions, b_logprobs, b_advantages, b_returns, b_values)
            for minibatch in zip(*(x[b_inds].split(minibatch_size) for x in batch)):
                pg_loss, v_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac = update(*minibatch)
                clipfracs.append(clipfrac)
                gradient_steps += 1
            # CleanRL's rule: after a whole epoch, stop if the last minibatch's KL estimate is past the
            # target; here the mean over the processes of theirs, so that they all stop together
            if args.target_kl is not None:
                mean_kl = approx_kl.clone()
                dist.all_reduce(mean_kl)
                if mean_kl.item() / world_size > args.target_kl:
                    break

        # LOG: once per iteration, the only place losses reach the host (with the --target-kl check)
        var_y = b_returns.var()
        explained_var = 1 - (b_returns - b_values).var() / var_y  # nan when the returns are constant
        losses = {
            "learning_rate": lrnow,
            "value_loss": v_loss.item(),
            "policy_loss": pg_loss.item(),
            "entropy": entropy_loss.item(),
            "old_approx_kl": old_approx_kl.item(),
            "approx_kl": approx_kl.item(),
            "clipfrac": torch.stack(clipfracs).mean().item(),
            "explained_variance": explained_var.item(),
        }
        # AGREE: the processes share the games that ended, their stop requests and their non-finite
        # losses, so that the counts cover every process's games and all of them leave the loop at the
        # same iteration (one that left alone would leave the others waiting in an all-reduce)
        nonfinite = [(k, losses[k]) for k in ("value_loss", "policy_loss", "entropy") if not math.isfinite(losses[k])]
        shared = all_gather((finished, stop_signal, nonfinite), world_size)
        for process_returns, _, _ in shared:
            returns_window.extend(process_returns)
            episodes += len(process_returns)
        stopping = next((signum for _, signum, _ in shared if signum is not None), None)
        nonfinite = [loss for _, _, process_nonfinite in shared for loss in process_nonfinite]
        sps = (global_step - steady_step) / (time.perf_counter() - steady_start) if steady_start is not None else None
        logs = {"episodic_return": float(np.mean(returns_window)) if returns_window else None, "sps": sps, **losses}
        pbar.set_postfix({k: f"{logs[k]:.4g}" for k in ("episodic_return", "sps", "value_loss") if logs[k] is not None}, refresh=False)
        metrics.writerow({"global_step": global_step, "wall_seconds": round(time.perf_counter() - start_time, 3), **logs})
        if wandb is not None:
            wandb.log({k: v for k, v in logs.items() if v is not None}, step=global_step)
        # a non-finite loss (in any process) ends the run: the weights are lost, and a checkpoint of them
        # would overwrite a good one
        if nonfinite:
            diverged = True
            break
        if args.save_model and args.checkpoint_every and global_step // args.checkpoint_every > last_saved // args.checkpoint_every:
            save()
            last_saved, saved = global_step, True
        if stopping is not None:
            break
    for s, h in previous_handlers.items():
        signal.signal(s, h)
    pbar.close()
    if start_iteration >= num_iterations:  # a finished run resumed: its curve still ends at its last step
        metrics.writerow({"global_step": global_step, "wall_seconds": round(time.perf_counter() - start_time, 3), "episodic_return": float(np.mean(returns_window)) if returns_window else None})
    if diverged:  # after the progress bar, so that the message has its own line
        where = f"the last checkpoint, {checkpoint_path}, is intact" if saved else "no checkpoint was saved"
        note(f"error: {nonfinite[0][0]} is {nonfinite[0][1]} at global step {global_step}: the run diverged; {where}")
    metrics_file.close()
    envs.close()
    end_time = time.perf_counter()
    if args.save_model and not diverged:
        save()
        saved = True

    # every process's weights as a checksum: the same value world_size times, or the processes drifted apart
    checksums = all_gather(hashlib.sha256(b"".join(p.detach().cpu().contiguous().numpy().tobytes() for p in agent.parameters())).hexdigest()[:16], world_size)

    # EVALUATION: by rank 0, after training, of the final weights (not after divergence). Under
    # torchrun not after a signal either (also one that came after the last iteration): torchrun kills
    # its processes 30 s (its --shutdown-timeout) after passing a signal on
    eval_return = None
    if args.eval_episodes > 0 and not diverged and "RANK" in os.environ and (stopping is not None or stop_signal is not None):
        note("note: a run under torchrun is not evaluated after a signal (torchrun kills its processes 30 s after one)")
    elif args.eval_episodes > 0 and not diverged and rank == 0:
        eval_return = evaluate(args, agent.state_dict(), n_act, device, memory_format)

    # SUMMARY: the last line on stdout, and runs/<run_name>/summary.json
    steady = steady_start is not None and global_step > steady_step
    summary = {
        "script": os.path.basename(__file__),
        "env_id": args.env_id,
        "seed": args.seed,
        "compile": False,
        "cudagraphs": False,
        "device": str(device),
        "torch": torch.__version__,
        "world_size": world_size,
        "local_num_envs": args.local_num_envs,
        "global_step": global_step,
        "wall_seconds": round(end_time - start_time, 3),
        # wall time of the first --measure-burnin iterations: compile and warm-up live here
        "compile_seconds": round((steady_start if steady_start is not None else end_time) - start_time, 3),
        "sps": round((global_step - steady_step) / (end_time - steady_start), 2) if steady else None,
        "episodic_return": float(np.mean(returns_window)) if returns_window and np.isfinite(returns_window).all() else None,
        "episodes": episodes,
        "gradient_steps": gradient_steps,
        # a diverged (non-finite) loss is null: NaN is not JSON
        "losses": {k: v if math.isfinite(v) else None for k, v in losses.items()},
        "run_name": run_name,
        "checkpoint": checkpoint_path if saved else None,
        "eval_return": eval_return,
        "eval_episodes": args.eval_episodes,
        "interrupted": stopping is not None,
        "diverged": diverged,
        "resumed_from": args.resume,
        "exit_code": 1 if diverged else 128 + stopping if stopping is not None else 0,
        "param_checksums": checksums,
    }
    if rank == 0:
        os.makedirs(f"runs/{run_name}", exist_ok=True)
        with open(f"runs/{run_name}/summary.json", "w") as f:
            json.dump(summary, f)
        if wandb is not None:
            wandb.summary.update(summary)
            wandb.finish()
        print(json.dumps(summary), flush=True)
    dist.destroy_process_group()
    # rank 0 alone says how the run ended: torchrun stops every process as soon as one exits with an
    # error code, which would cut rank 0's evaluation and summary short. (No collective follows the
    # checksums, so the other processes need not wait for rank 0.)
    return summary if rank == 0 else {**summary, "exit_code": 0}


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Args))["exit_code"])
