"""The ALFWorld student prompt (ALGORITHM.md §1.3): verl-agent's wording, reconstructed."""

from __future__ import annotations

from alignopsd.engine.envs.prompts import PromptBuilder

ALFWORLD_TEMPLATE_NO_HIS = """
You are an expert agent operating in the ALFRED Embodied Environment.
Your current observation is: {current_observation}
Your admissible actions of the current situation are: [{admissible_actions}].

Now it's your turn to take an action.
You should first reason step-by-step about the current situation. This reasoning process MUST be enclosed \
within <think> </think> tags.
Once you've finished your reasoning, you should choose an admissible action for current step and present \
it within <action> </action> tags.
"""

ALFWORLD_TEMPLATE = """
You are an expert agent operating in the ALFRED Embodied Environment. Your task is to: {task_description}
Prior to this step, you have already taken {step_count} step(s). Below are the most recent {history_length} \
observations and the corresponding actions you took: {action_history}
You are now at step {current_step} and your current observation is: {current_observation}
Your admissible actions of the current situation are: [{admissible_actions}].

Now it's your turn to take an action.
You should first reason step-by-step about the current situation. This reasoning process MUST be enclosed \
within <think> </think> tags.
Once you've finished your reasoning, you should choose an admissible action for current step and present \
it within <action> </action> tags.
"""


def alfworld_prompt(history_length: int = 2) -> PromptBuilder:
    """The ALFWorld builder of §1.3 (``history_length`` 2 in every profile)."""
    return PromptBuilder(ALFWORLD_TEMPLATE_NO_HIS, ALFWORLD_TEMPLATE, history_length)
