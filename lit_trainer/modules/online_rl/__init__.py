"""The base of the online-RL modules, :class:`~lit_trainer.modules.online_rl.online_rl_module.OnlineRLModule`
(GRPO's and RLOO's rollouts, rewards, round buffer, reference model and validation), with its private parts beside
it: calling the reward functions, the round buffer, the completion log-prob forward, the completions table and the
option checks."""

from lit_trainer.modules.online_rl.online_rl_module import OnlineRLModule

__all__ = ["OnlineRLModule"]
