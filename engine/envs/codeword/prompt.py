"""The codeword toy environment's student prompt: the whole (4-step) episode stays visible."""

from __future__ import annotations

from alignopsd.engine.envs.prompts import PromptBuilder

CODEWORD_TEMPLATE_NO_HIS = """You are playing a memory game.
Observation: {current_observation}
Admissible actions: [{admissible_actions}].
Think inside <think> </think>, then give exactly one admissible action inside <action> </action>.
"""

CODEWORD_TEMPLATE = """You are playing a memory game. You have already taken {step_count} step(s):
{action_history}
You are now at step {current_step}. Observation: {current_observation}
Admissible actions: [{admissible_actions}].
Think inside <think> </think>, then give exactly one admissible action inside <action> </action>.
"""


def codeword_prompt(history_length: int = 4) -> PromptBuilder:
    """Toy builder: shows the whole (4-step) episode so the code word stays visible."""
    return PromptBuilder(
        CODEWORD_TEMPLATE_NO_HIS,
        CODEWORD_TEMPLATE,
        history_length,
        history_item="Step {index}: observation '{observation}', action '{action}'",
        action_sep=", ",
    )
