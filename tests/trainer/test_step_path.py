"""What a training step pays for, and only that: the callback handler calls, for each event, only the
callbacks that do something on it (worked out once, again when the callbacks change), so a step pays
nothing for events nobody overrides."""

from __future__ import annotations

import pytest

from mixprec.trainer.callbacks import CallbackHandler, DefaultFlowCallback, TrainerCallback, TrainerControl


class Counts(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append("step_end")


def test_only_callbacks_that_override_an_event_are_called_for_it():
    counts = Counts()
    handler = CallbackHandler([DefaultFlowCallback, counts])
    assert handler.listeners("on_step_begin") == [] and handler.listeners("on_pre_optimizer_step") == []
    assert handler.listeners("on_step_end") == [handler.callbacks[0], counts]
    handler.call("on_step_begin", None, None, TrainerControl())
    handler.callbacks.pop(0)
    handler.call("on_step_end", None, None, TrainerControl())
    assert counts.seen == ["step_end"]


def test_a_callback_added_later_or_a_method_set_on_an_instance_is_called():
    handler = CallbackHandler([])
    assert handler.listeners("on_log") == []
    late = Counts()
    handler.callbacks.append(late)  # the list changed directly: worked out again
    assert handler.listeners("on_step_end") == [late]
    plain = TrainerCallback()
    calls = []
    plain.on_log = lambda args, state, control, **kw: calls.append(kw["logs"])
    handler.add_callback(plain)
    handler.call("on_log", None, None, TrainerControl(), logs={"loss": 1.0})
    assert calls == [{"loss": 1.0}]


def test_transformers_callbacks_base_no_ops_are_skipped_and_their_overrides_called():
    transformers = pytest.importorskip("transformers")

    class Theirs(transformers.TrainerCallback):
        def on_epoch_end(self, args, state, control, **kwargs):
            control.should_training_stop = True

    handler = CallbackHandler([Theirs()])
    assert handler.listeners("on_step_end") == [] and len(handler.listeners("on_epoch_end")) == 1
    assert handler.call("on_epoch_end", None, None, TrainerControl()).should_training_stop


def test_the_flags_an_event_clears_are_cleared_even_when_nobody_listens():
    control = TrainerControl(should_log=True, should_save=True)
    CallbackHandler([]).call("on_step_begin", None, None, control)
    assert not control.should_log and not control.should_save
