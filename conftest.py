# Fixture modules shared by every test folder (see docs/DEVELOPING.md).
pytest_plugins = [
    "tests.fixtures.cluster",
    "tests.fixtures.azurite",
]
