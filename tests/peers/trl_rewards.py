"""A reward written the TRL way for a conversational dataset: completion[0]["content"], the `solution` column,
trainer_state and log_metric by name. Written for vlmrl's tests; not TRL's code."""


def think_length(completions, solution, trainer_state=None, log_metric=None, **kwargs):
    texts = [c[0]["content"] for c in completions]
    if log_metric is not None:
        log_metric("think_length/step", float(trainer_state.global_step))
    return [min(len(t), 40) / 40 for t in texts]
