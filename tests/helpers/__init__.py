"""What several test rooms share (tests/ is on sys.path: pyproject's [tool.pytest.ini_options]
pythonpath): test data makers, scripted engines, app launchers, the Space-like container. Fixtures
live in the conftest.py of the folder that uses them."""
