"""The task registry: names, the Task record's checks, and loading a user's factory by name."""

from __future__ import annotations

import dataclasses

import pytest

from mixprec.tasks import TASKS, Task, get_task, list_tasks, load_factory, load_task


def test_unknown_task_name_lists_the_built_in_ones():
    with pytest.raises(ValueError, match=r"the built-in tasks are \['pycode', 'digits'\]"):
        get_task("cifar")


def test_list_tasks_names_every_task_get_task_accepts():
    assert list_tasks() == {"pycode": ["tiny", "mini", "small"], "digits": []}


def test_task_is_frozen_and_checks_its_callables():
    task = get_task("digits")
    with pytest.raises(dataclasses.FrozenInstanceError):
        task.name = "other"
    with pytest.raises(TypeError, match="Task.build_model must be callable"):
        dataclasses.replace(task, build_model=None)


def test_build_model_returns_a_fresh_model_each_call():
    task = get_task("pycode", "tiny", max_bytes=1024, eval_max_bytes=1024)
    assert task.build_model() is not task.build_model()


def test_load_factory_returns_the_named_object_including_a_dotted_attribute():
    assert load_factory("mixprec.tasks:get_task") is get_task
    assert load_factory("mixprec.tasks:Task.__post_init__") is Task.__post_init__


def test_load_factory_names_the_module_that_was_not_found():
    with pytest.raises(ImportError, match="module 'no_such_pkg.models' .* was not found"):
        load_factory("no_such_pkg.models:build")


def test_load_factory_names_the_attribute_that_was_not_found():
    with pytest.raises(AttributeError, match="module 'mixprec.tasks' has no attribute 'no_such_factory'"):
        load_factory("mixprec.tasks:no_such_factory")


@pytest.mark.parametrize("spec", ["mixprec.tasks", ":get_task", "mixprec.tasks:", "a:b:c"])
def test_load_factory_rejects_a_malformed_spec_with_the_expected_form(spec):
    with pytest.raises(ValueError, match="must look like 'package.module:factory'"):
        load_factory(spec)


def test_load_factory_rejects_an_object_that_is_not_callable():
    with pytest.raises(TypeError, match="not a callable factory"):
        load_factory("mixprec.tasks.pycode:PYCODE_SIZES")


def test_each_registry_entry_takes_its_builders_parameters_as_options():
    assert TASKS["pycode"].variant == "size" and TASKS["pycode"].variants == ("tiny", "mini", "small")
    assert list(TASKS["pycode"].options) == ["size", "max_bytes", "eval_max_bytes", "root"]
    assert TASKS["digits"].variant == "arch" and list(TASKS["digits"].options) == ["arch", "seed"]
    assert TASKS["pycode"].defaults["size"] == "mini" and TASKS["digits"].defaults["arch"] == "mlp"


def test_get_task_and_load_task_build_the_same_registered_task():
    assert get_task("digits", arch="cnn").name == load_task("digits", arch="cnn").name == "digits/cnn"
    with pytest.raises(ValueError, match=r"unknown digits arch 'resnet'; choose one of \['mlp', 'cnn'\]"):
        TASKS["digits"](arch="resnet")


def test_load_factory_is_importable_from_its_own_module_and_the_package():
    from mixprec.tasks.factory import load_factory as own

    assert own is load_factory
