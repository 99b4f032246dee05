"""The task registry: names, the Task record's checks, and loading a user's factory by name."""

from __future__ import annotations

import dataclasses

import pytest

from mixprec.tasks import Task, get_task, list_tasks, load_factory


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
