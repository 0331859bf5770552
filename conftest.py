# Repository root on sys.path so `tests.helpers` and spawned children import the same modules.
