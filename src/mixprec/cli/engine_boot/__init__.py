"""What ``mixprec run`` puts first on the ``PYTHONPATH`` of the processes it starts."""
