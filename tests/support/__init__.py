"""The suite's helper modules: everything the tests share that is not a test.

A module of tests/ or of one of its folders is a test file (``test_*.py``), a
``conftest.py`` or a package's ``__init__.py``; every other module lives here
(``tests/project/test_suite_shape.py`` keeps it so). Tests import them relatively:
``from ..support.oracle import Config``, ``from ..support import background``.
"""
