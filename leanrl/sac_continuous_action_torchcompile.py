"""Soft Actor-Critic (SAC) for continuous actions: the torch.compile / CUDA-graph twin.

Haarnoja et al., "Soft Actor-Critic Algorithms and Applications", 2018, https://arxiv.org/abs/1812.05905
Twin Q-networks with Polyak-averaged targets, automatic entropy tuning and CleanRL's delayed (but
compensated) policy updates, with CleanRL's hyper-parameters. It computes what sac_continuous_action.py computes; `diff` the
two files to see what compiling takes: the twin Q-networks as one stacked parameter set under
torch.vmap, updates compiled with torch.compile and replayed as CUDA graphs (tensordict's
CudaGraphModule), and an acting copy of the policy that shares the learner's weights.

    python leanrl/sac_continuous_action_torchcompile.py --compile --cudagraphs
"""

import csv
import dataclasses
import difflib
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
    """if toggled, cuda will be used when available (the script falls back to the CPU with a note)"""
    track: bool = False
    """if toggled, this experiment will be tracked with Weights and Biases (honours WANDB_MODE)"""
    wandb_project_name: str = "leanrl"
    """the wandb's project name"""
    wandb_entity: Optional[str] = None
    """the entity (team) of wandb's project"""
    capture_video: bool = False
    """whether to capture videos of the agent performances (check out `videos` folder; needs moviepy)"""
    save_model: bool = False
    """whether to save a checkpoint (weights, optimiser state, RNG states, step, args) to runs/{run_name}/checkpoint.pt at the end"""
    checkpoint_every: int = 0
    """with --save-model, also save the checkpoint every this many steps (0: only at the end)"""
    resume: Optional[str] = None
    """a checkpoint.pt to continue from to its own --total-timesteps (env, seed, budget and hyper-parameters come from the checkpoint); the replay buffer is not saved: after a resume the restored policy refills it for --learning-starts steps (counted in the budget) before updates start again"""
    eval_episodes: Optional[int] = None
    """episodes to evaluate the final policy deterministically (mean action / argmax) after training; default 10 with --save-model, else 0"""

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
    learning_starts: int = 5_000
    """timestep to start learning (actions are uniformly random until then)"""
    policy_lr: float = 3e-4
    """the learning rate of the policy network optimizer"""
    q_lr: float = 1e-3
    """the learning rate of the Q network optimizer"""
    policy_frequency: int = 2
    """the frequency of training policy (delayed); it then takes this many steps to compensate"""
    target_network_frequency: int = 1
    """the frequency of updates for the target networks"""
    alpha: float = 0.2
    """entropy regularization coefficient (the fixed value with `--no-autotune`)"""
    autotune: bool = True
    """automatic tuning of the entropy coefficient"""

    # Performance
    compile: bool = False
    """whether to compile the updates and the policy with torch.compile"""
    cudagraphs: bool = False
    """whether to replay the updates and the policy as CUDA graphs (CUDA only: on a CPU it warns and runs without)"""
    measure_burnin: int = 10
    """training iterations (compile, warm-up) left out of the steady-state sps"""
    log_every: int = 100
    """iterations between two reads of the losses (each read synchronises host and device)"""


# what a resumed run takes from its command line; the rest (env, seed, budget, hyper-parameters) comes from the checkpoint
SESSION_FLAGS = {"cuda", "track", "wandb_project_name", "wandb_entity", "capture_video", "save_model", "checkpoint_every", "resume", "eval_episodes", "compile", "cudagraphs", "measure_burnin", "log_every"}


def fail(message: str):
    """Stops with a one-line message and exit code 2: bad input never ends in a traceback."""
    print(f"error: {message}", file=sys.stderr)
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
            print(f"note: --resume continues the checkpoint's run: --{name.replace('_', '-')} stays {saved[name]}", file=sys.stderr)
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


def check_args(args: Args):
    for name in ("total_timesteps", "num_envs", "buffer_size", "batch_size", "policy_frequency", "target_network_frequency"):
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0 <= args.seed < 2**32:  # numpy's seed range
        fail(f"--seed must lie in [0, 2**32), got {args.seed}")
    if args.learning_starts < 0:
        fail(f"--learning-starts must be >= 0, got {args.learning_starts}")
    if args.total_timesteps // args.num_envs <= args.learning_starts // args.num_envs:
        fail(
            f"--total-timesteps ({args.total_timesteps}) must be larger than --learning-starts "
            f"({args.learning_starts}), or no update ever runs: raise the budget or lower --learning-starts"
        )
    if args.batch_size > args.buffer_size:
        fail(f"--batch-size ({args.batch_size}) is larger than --buffer-size ({args.buffer_size}): lower it or grow the buffer")
    if args.buffer_size % args.num_envs:
        fail(f"--buffer-size ({args.buffer_size}) must be a multiple of --num-envs ({args.num_envs})")
    if not (0.0 <= args.gamma <= 1.0 and 0.0 <= args.tau <= 1.0):  # also false for nan
        fail(f"--gamma ({args.gamma}) and --tau ({args.tau}) must lie in [0, 1]")
    for name in ("policy_lr", "q_lr"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0):
            fail(f"--{name.replace('_', '-')} must be a positive number, got {getattr(args, name)}")
    if not (math.isfinite(args.alpha) and args.alpha >= 0):
        fail(f"--alpha must be a non-negative number, got {args.alpha}")
    if args.measure_burnin < 0 or args.log_every <= 0:
        fail("--measure-burnin must be >= 0 and --log-every positive")
    if args.checkpoint_every < 0:
        fail(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    if args.checkpoint_every > 0 and not args.save_model:
        fail("--checkpoint-every needs --save-model")
    if args.eval_episodes is not None and args.eval_episodes < 0:
        fail(f"--eval-episodes must be >= 0, got {args.eval_episodes}")
    if args.capture_video:
        try:  # checked before any work, not found out when the first video is written
            os.makedirs("videos", exist_ok=True)
            writable = os.access("videos", os.W_OK)
        except OSError:  # e.g. a file named videos
            writable = False
        if not writable:
            fail("--capture-video writes to videos/, which cannot be written here: run from a writable folder")
        try:
            import moviepy  # noqa: F401  (gymnasium's RecordVideo writes with it)
        except ImportError:
            fail("--capture-video needs moviepy: pip install moviepy")
    try:
        gym.spec(args.env_id)
    except gym.error.Error:
        close = difflib.get_close_matches(args.env_id, list(gym.registry), n=3)
        hint = f"did you mean {', '.join(close)}?" if close else "pick one from gymnasium.registry"
        fail(f"unknown env id {args.env_id!r}: {hint}")
    try:
        env = gym.make(args.env_id)
    except (gym.error.Error, ImportError) as e:  # e.g. an env whose simulator is not installed
        fail(f"cannot make {args.env_id}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    act_space, obs_space = env.action_space, env.observation_space
    env.close()
    if not isinstance(act_space, gym.spaces.Box):
        fail(f"SAC needs a continuous (Box) action space, but {args.env_id} has {act_space}: use a discrete-action script such as DQN or PPO")
    if not (np.isfinite(act_space.low).all() and np.isfinite(act_space.high).all()):
        fail(f"SAC squashes actions into the action bounds, but {args.env_id} has infinite bounds: wrap it in gymnasium.wrappers.RescaleAction")
    if not isinstance(obs_space, gym.spaces.Box) or len(obs_space.shape) != 1:
        fail(f"SAC's MLPs need a flat Box observation space, but {args.env_id} has {obs_space}: wrap it in gymnasium.wrappers.FlattenObservation")


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
    """The replay rows (num_envs, obs + act + 1 + obs + 1), float32, of one vector step. Same-step
    autoreset returns the reset observation as next_obs of an env whose episode just ended and puts
    the true last one in infos["final_obs"]: that is the one to store, so no transition crosses a
    reset. Only terminations are stored as dones: a time-limit truncation still bootstraps."""
    real_next_obs = next_obs.copy()
    if "final_obs" in infos:
        for i in np.flatnonzero(infos["_final_obs"]):
            real_next_obs[i] = infos["final_obs"][i]
    return np.concatenate([obs, actions, rewards[:, None], real_next_obs, terminations[:, None]], axis=1, dtype=np.float32)


class SoftQNetwork(nn.Module):
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


LOG_STD_MAX = 2
LOG_STD_MIN = -5


class Actor(nn.Module):
    def __init__(self, n_obs, action_space, device=None):
        super().__init__()
        n_act = math.prod(action_space.shape)
        self.fc1 = nn.Linear(n_obs, 256, device=device)
        self.fc2 = nn.Linear(256, 256, device=device)
        self.fc_mean = nn.Linear(256, n_act, device=device)
        self.fc_logstd = nn.Linear(256, n_act, device=device)
        # action rescaling: tanh's (-1, 1) onto [low, high]
        high = torch.as_tensor(action_space.high, dtype=torch.float32, device=device)
        low = torch.as_tensor(action_space.low, dtype=torch.float32, device=device)
        self.register_buffer("action_scale", (high - low) / 2.0)
        self.register_buffer("action_bias", (high + low) / 2.0)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        mean = self.fc_mean(x)
        log_std = torch.tanh(self.fc_logstd(x))
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)  # from SpinUp / Denis Yarats
        return mean, log_std

    def get_action(self, x):
        """Samples a squashed Gaussian action; returns (action, log_prob (batch, 1), deterministic action)."""
        mean, log_std = self(x)
        eps = torch.randn_like(mean)
        x_t = mean + log_std.exp() * eps  # reparameterisation trick, differentiable in mean and log_std
        y_t = torch.tanh(x_t)
        action = y_t * self.action_scale + self.action_bias
        # Gaussian log-density written out (torch.distributions.Normal validates its arguments on every
        # call), minus the log-det of the tanh squashing in its stable form log(1 - tanh(x)^2) =
        # 2 (log 2 - x - softplus(-2x)) (SpinningUp's SAC), and of the rescaling
        log_prob = -0.5 * eps.pow(2) - log_std - 0.5 * math.log(2 * math.pi)
        log_prob = log_prob - 2.0 * (math.log(2.0) - x_t - F.softplus(-2.0 * x_t)) - self.action_scale.log()
        return action, log_prob.sum(1, keepdim=True), torch.tanh(mean) * self.action_scale + self.action_bias


def make_updates(args, actor, qnet, qnet_params, qnet_target, log_alpha, target_entropy):
    """Builds the optimisers and the three update steps; each step is a function over tensors on the
    device with no host synchronisation, so the compiled twin can compile it whole."""
    # the stacked tensors themselves, keyed "fc1.weight", ...: torch.func.functional_call runs the
    # weightless shell with them. (tensordict's `with params.to_module(qnet)` does the same, but two
    # such calls in one compiled function crash dynamo in torch 2.13)
    q_weights = dict(qnet_params.flatten_keys(".").items())
    # the same storage without autograd: the actor's loss must not reach the critics' weights. A compiled
    # backward computes every gradient its graph allows, so backward(inputs=...) alone would not spare them
    q_weights_detached = dict(qnet_params.data.flatten_keys(".").items())
    q_target_weights = dict(qnet_target.flatten_keys(".").items())
    actor_params = list(actor.parameters())
    q_params = list(q_weights.values())
    q_target_params = list(q_target_weights.values())
    # fused: one kernel per parameter for Adam's update, 3-4x faster than the default loop on a CPU. It
    # runs outside torch.compile (dynamo does not trace it), so a CUDA graph that replays the update
    # needs it capturable (step counts on the device) with or without --compile
    capturable = args.cudagraphs
    q_optimizer = torch.optim.Adam(q_params, lr=args.q_lr, fused=True, capturable=capturable)
    actor_optimizer = torch.optim.Adam(actor_params, lr=args.policy_lr, fused=True, capturable=capturable)
    a_optimizer = torch.optim.Adam([log_alpha], lr=args.q_lr, fused=True, capturable=capturable) if args.autotune else None

    def batched_qf(weights, obs, action):
        return torch.func.functional_call(qnet, weights, (obs, action))

    qf = torch.vmap(batched_qf, (0, None, None))  # (2, batch, 1): both Q-networks in one batched call

    def update_critic(obs, actions, rewards, next_obs, dones):
        alpha = log_alpha.detach().exp()
        with torch.no_grad():
            next_actions, next_log_pi, _ = actor.get_action(next_obs)
            qf_next_target = qf(q_target_weights, next_obs, next_actions).min(0).values
            # (batch, 1): terminations stop the bootstrap, time-limit truncations do not (dones = terminations)
            next_q_value = rewards + (1.0 - dones) * args.gamma * (qf_next_target - alpha * next_log_pi)
        qf_a_values = qf(q_weights, obs, actions)
        qf_loss = (qf_a_values - next_q_value).pow(2).mean((1, 2)).sum()  # qf1 MSE + qf2 MSE
        q_optimizer.zero_grad()
        qf_loss.backward()
        q_optimizer.step()
        return qf_loss.detach()

    def update_actor(obs):
        alpha = log_alpha.detach().exp()
        pi, log_pi, _ = actor.get_action(obs)
        min_qf_pi = qf(q_weights_detached, obs, pi).min(0).values
        actor_loss = (alpha * log_pi - min_qf_pi).mean()
        actor_optimizer.zero_grad()
        # gradients for the actor only: the critics' weight gradients would be computed, then discarded
        actor_loss.backward(inputs=actor_params)
        actor_optimizer.step()
        if a_optimizer is None:
            return actor_loss.detach(), alpha
        # reuses this step's log_pi (as LeanRL does) instead of a second actor forward pass (CleanRL)
        alpha_loss = (-log_alpha.exp() * (log_pi.detach() + target_entropy)).mean()
        a_optimizer.zero_grad()
        alpha_loss.backward()
        a_optimizer.step()
        return actor_loss.detach(), log_alpha.detach().exp()

    @torch.no_grad()
    def update_targets():
        torch._foreach_lerp_(q_target_params, q_params, args.tau)  # Polyak: t += tau * (p - t)

    return (q_optimizer, actor_optimizer, a_optimizer), (update_critic, update_actor, update_targets)


def evaluate(args, actor_state, device):
    """Mean return of --eval-episodes episodes of the deterministic policy (the squashed mean), played
    by a fresh copy of the actor in a fresh env seeded seed + 100_000 + i, so evaluation is reproducible."""
    env = gym.make(args.env_id)
    actor = Actor(math.prod(env.observation_space.shape), env.action_space, device=device)
    actor.load_state_dict(actor_state)
    total = 0.0
    for i in range(args.eval_episodes):
        obs, _ = env.reset(seed=args.seed + 100_000 + i)
        done = False
        while not done:
            with torch.no_grad():
                _, _, action = actor.get_action(torch.as_tensor(obs, dtype=torch.float32, device=device)[None])
            obs, reward, terminated, truncated, _ = env.step(action[0].cpu().numpy())
            total += float(reward)
            done = terminated or truncated
    env.close()
    return total / args.eval_episodes


def main(args: Args) -> dict:
    checkpoint = load_checkpoint(args.resume) if args.resume else None
    if checkpoint is not None:
        args = resume_args(args, checkpoint)
    check_args(args)
    if args.eval_episodes is None:
        args.eval_episodes = 10 if args.save_model else 0
    run_name = f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"

    # SEEDING AND DEVICE
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    if args.cuda and not torch.cuda.is_available():
        print("note: CUDA is not available, running on the CPU", file=sys.stderr)
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    if args.cudagraphs and device.type != "cuda":
        print("warning: --cudagraphs needs CUDA: running without CUDA graphs", file=sys.stderr)
        args.cudagraphs = False

    wandb = None
    if args.track:
        import wandb  # only imported when asked for: no account or network needed otherwise

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=vars(args), name=run_name, save_code=True)

    # ENVIRONMENTS: same-step autoreset puts the true last observation of a finished episode in
    # infos["final_obs"] and returns the reset observation as next_obs, so no transition crosses a reset
    envs = gym.vector.SyncVectorEnv(
        [make_env(args.env_id, args.seed + i, i, args.capture_video, run_name) for i in range(args.num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    envs = gym.wrappers.vector.RecordEpisodeStatistics(envs)
    n_obs = math.prod(envs.single_observation_space.shape)
    n_act = math.prod(envs.single_action_space.shape)

    # AGENT
    actor = Actor(n_obs, envs.single_action_space, device=device)
    qf1 = SoftQNetwork(n_obs, n_act, device=device)
    qf2 = SoftQNetwork(n_obs, n_act, device=device)
    # the twin Q-networks as one stacked (2, ...) parameter set, evaluated together under torch.vmap
    qnet_params = from_modules(qf1, qf2, as_module=True)
    qnet_target = qnet_params.data.clone()
    qnet = SoftQNetwork(n_obs, n_act, device="meta")  # a shell without weights, filled by to_module
    # with autotune alpha starts at 1 (log_alpha = 0), as in CleanRL; otherwise it stays at --alpha
    log_alpha = torch.tensor(0.0 if args.autotune else math.log(max(args.alpha, 1e-30)), device=device, requires_grad=args.autotune)
    target_entropy = -float(n_act)
    optimizers, (update_critic, update_actor, update_targets) = make_updates(
        args, actor, qnet, qnet_params, qnet_target, log_alpha, target_entropy
    )
    # the learner's tensors by module (state_dict views, sharing storage): the checkpoint's model
    learner = {"actor": actor.state_dict(), "qnet_params": qnet_params.state_dict(), "qnet_target": qnet_target.state_dict()}
    learner["alpha"] = {"log_alpha": log_alpha.detach()}

    # RESUME: in place (copy_ into the views above, the optimisers' own load_state_dict), so the
    # optimisers and any compiled graph keep the tensors they hold; the RNG states last
    returns = deque(maxlen=10)  # the last 10 finished episodes
    episodes, global_step = 0, 0
    if checkpoint is not None:
        with torch.no_grad():
            for name, tensors in learner.items():
                for key, tensor in tensors.items():
                    tensor.copy_(checkpoint["model"][name][key])
        for name, optimizer in zip(("q", "actor", "alpha"), optimizers):
            if optimizer is not None:
                optimizer.load_state_dict(checkpoint["optimizer"][name])
        episodes, global_step = checkpoint["episodes"], checkpoint["global_step"]
        returns.extend(checkpoint["returns"])
        set_rng_states(checkpoint["rng"])

    def make_checkpoint():
        return {
            "script": os.path.basename(__file__),
            "args": dataclasses.asdict(args),
            "global_step": global_step,
            "episodes": episodes,
            "returns": list(returns),
            "rng": rng_states(),
            "model": learner,
            "optimizer": {name: optimizer.state_dict() for name, optimizer in zip(("q", "actor", "alpha"), optimizers) if optimizer is not None},
        }

    # the acting policy: a copy that shares the learner's weights, detached from autograd
    actor_detach = Actor(n_obs, envs.single_action_space, device="meta")
    from_module(actor).data.to_module(actor_detach)
    policy = actor_detach.get_action

    # COMPILE: torch.compile fuses each step's kernels; CudaGraphModule then records the launches
    # once and replays them, removing the per-kernel launch cost that dominates at these sizes
    if args.compile:
        update_critic = torch.compile(update_critic)
        update_actor = torch.compile(update_actor)
        policy = torch.compile(policy)
    if args.cudagraphs:
        update_critic = CudaGraphModule(update_critic)
        update_actor = CudaGraphModule(update_actor)
        policy = CudaGraphModule(policy)

    # REPLAY BUFFER: one float32 table on the device, a row (obs, action, reward, next_obs, termination)
    # per transition, so storing costs one host-to-device copy and sampling one gather
    fields = [n_obs, n_act, 1, n_obs, 1]
    try:
        rb = torch.zeros((args.buffer_size, sum(fields)), dtype=torch.float32, device=device)
    except (RuntimeError, MemoryError):  # out of memory: a plain message, not an allocator traceback
        fail(f"no room for a replay buffer of {args.buffer_size * sum(fields) * 4 / 2**30:.1f} GiB on {device}: lower --buffer-size")
    rb_pos, rb_size = 0, 0

    # CURVE: every logged point also goes to runs/<run_name>/metrics.csv (line-buffered, an empty
    # cell where there is no value yet), so that curves can be plotted without wandb
    os.makedirs(f"runs/{run_name}", exist_ok=True)
    metrics_file = open(f"runs/{run_name}/metrics.csv", "w", newline="", buffering=1)
    metrics = csv.DictWriter(metrics_file, ["global_step", "wall_seconds", "episodic_return", "sps", "qf_loss", "actor_loss", "alpha"], lineterminator="\n")
    metrics.writeheader()

    # TRAINING LOOP: a resumed run plays fresh episodes (seeded past the first ones) and, as its replay
    # buffer was not saved, refills it with its restored policy for --learning-starts steps
    num_iterations = args.total_timesteps // args.num_envs
    start_iteration = global_step // args.num_envs
    first_update = start_iteration + args.learning_starts // args.num_envs  # iterations before the first update
    steady_from = min(first_update + args.measure_burnin, num_iterations)
    start_time = time.perf_counter()
    burnin_start = steady_start = None
    qf_loss = actor_loss = alpha = None
    checkpoint_path, last_saved, saved, diverged = f"runs/{run_name}/checkpoint.pt", global_step, False, None
    obs, _ = envs.reset(seed=args.seed + global_step)

    # STOPPING: Ctrl-C (SIGINT) or SIGTERM lets the current iteration finish, then the run checkpoints
    # (with --save-model) and summarises; a second signal stops at once
    stop_signal = None

    def request_stop(signum, frame):
        nonlocal stop_signal
        stop_signal = signum
        signal.signal(signum, signal.SIG_DFL)

    previous_handlers = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    pbar = tqdm.tqdm(range(start_iteration, num_iterations), file=sys.stderr, mininterval=1.0)
    for iteration in pbar:
        if iteration == first_update:
            burnin_start = time.perf_counter()
        if iteration == steady_from:
            steady_start, steady_step = time.perf_counter(), global_step
        global_step += args.num_envs

        # ACT: uniformly random until learning starts (a resumed run's restored policy refills the buffer),
        # then sampled from the policy
        if iteration < first_update and checkpoint is None:
            actions = envs.action_space.sample()
        else:
            with torch.no_grad():
                actions, _, _ = policy(torch.as_tensor(obs, dtype=torch.float32, device=device))
            actions = actions.cpu().numpy()
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)

        if "episode" in infos:
            for r in infos["episode"]["r"][infos["_episode"]]:
                returns.append(float(r))
                episodes += 1

        # STORE TRANSITION
        rows = transition_rows(obs, actions, rewards, next_obs, terminations, infos)
        rb[rb_pos : rb_pos + args.num_envs].copy_(torch.from_numpy(rows))
        rb_pos = (rb_pos + args.num_envs) % args.buffer_size
        rb_size = min(rb_size + args.num_envs, args.buffer_size)
        obs = next_obs

        # UPDATE
        if iteration >= first_update:
            idx = torch.randint(0, rb_size, (args.batch_size,), device=device)
            data = rb[idx].split(fields, dim=1)  # obs, actions, rewards, next_obs, dones
            qf_loss = update_critic(*data)
            if iteration % args.policy_frequency == 0:
                for _ in range(args.policy_frequency):  # compensates for the delay (CleanRL)
                    actor_loss, alpha = update_actor(data[0])
            if iteration % args.target_network_frequency == 0:
                update_targets()

        # LOG: the only place losses reach the host; a periodic checkpoint first checks they are finite
        checkpoint_due = args.save_model and args.checkpoint_every > 0 and global_step // args.checkpoint_every > last_saved // args.checkpoint_every
        stopping = stop_signal is not None  # read once: a signal after this line stops the next iteration
        if iteration % args.log_every == 0 or iteration == num_iterations - 1 or checkpoint_due or stopping:
            sps = None
            if steady_start is not None and global_step > steady_step:
                sps = (global_step - steady_step) / (time.perf_counter() - steady_start)
            logs = {"episodic_return": float(np.mean(returns)) if returns else None, "sps": sps}
            if actor_loss is not None:
                logs.update(qf_loss=qf_loss.item(), actor_loss=actor_loss.item(), alpha=alpha.item())
            diverged = next((name for name in ("qf_loss", "actor_loss", "alpha") if name in logs and not math.isfinite(logs[name])), None)
            pbar.set_postfix({k: f"{v:.4g}" for k, v in logs.items() if v is not None}, refresh=False)
            metrics.writerow({"global_step": global_step, "wall_seconds": round(time.perf_counter() - start_time, 3), **logs})
            if wandb is not None:
                wandb.log({k: v for k, v in logs.items() if v is not None}, step=global_step)
        if diverged is not None:
            break
        if checkpoint_due:
            save_checkpoint(checkpoint_path, make_checkpoint())
            last_saved, saved = global_step, True
        if stopping:
            break
    pbar.close()
    for s, h in previous_handlers.items():
        signal.signal(s, h)
    if start_iteration >= num_iterations:  # a finished run resumed: its curve still ends at its last step
        metrics.writerow({"global_step": global_step, "wall_seconds": round(time.perf_counter() - start_time, 3), "episodic_return": float(np.mean(returns)) if returns else None})
    metrics_file.close()
    envs.close()
    if diverged is not None:
        where = f"the last checkpoint, {checkpoint_path}, is intact" if saved else "no checkpoint was saved"
        print(f"error: {diverged} is {logs[diverged]} at global step {global_step}: the run diverged; {where}", file=sys.stderr)
    elif args.save_model:
        save_checkpoint(checkpoint_path, make_checkpoint())
        saved = True
    # EVALUATION: the final policy, also after an interrupt, never after a divergence
    eval_return = evaluate(args, actor.state_dict(), device) if args.eval_episodes > 0 and diverged is None else None

    # SUMMARY: the last line on stdout, and runs/<run_name>/summary.json
    end_time = time.perf_counter()
    steady = steady_start is not None and global_step > steady_step
    summary = {
        "script": os.path.basename(__file__),
        "env_id": args.env_id,
        "seed": args.seed,
        "compile": args.compile,
        "cudagraphs": args.cudagraphs,
        "device": str(device),
        "torch": torch.__version__,
        "global_step": global_step,
        "wall_seconds": round(end_time - start_time, 3),
        # wall time of the first --measure-burnin training iterations: compile and warm-up live here
        "compile_seconds": round((steady_start if steady_start is not None else end_time) - burnin_start, 3) if burnin_start is not None else None,
        "sps": round((global_step - steady_step) / (end_time - steady_start), 2) if steady else None,
        "episodic_return": float(np.mean(returns)) if returns and np.isfinite(returns).all() else None,
        "episodes": episodes,
        # a diverged (non-finite) loss is null: NaN is not JSON
        "losses": {k: v.item() if torch.isfinite(v) else None for k, v in (("qf_loss", qf_loss), ("actor_loss", actor_loss), ("alpha", alpha)) if v is not None},
        "run_name": run_name,
        "checkpoint": checkpoint_path if saved else None,
        "eval_return": eval_return,
        "eval_episodes": args.eval_episodes,
        "interrupted": stop_signal is not None,
        "diverged": diverged is not None,
        "resumed_from": args.resume,
        "exit_code": 1 if diverged is not None else 128 + stop_signal if stop_signal is not None else 0,
    }
    os.makedirs(f"runs/{run_name}", exist_ok=True)
    with open(f"runs/{run_name}/summary.json", "w") as f:
        json.dump(summary, f)
    if wandb is not None:
        wandb.summary.update(summary)
        wandb.finish()
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Args))["exit_code"])
