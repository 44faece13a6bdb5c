"""The model families. Importing the package registers every family with ModelConfig
(models/families.py), whatever module of it is asked for first."""
from kvslim.models import families as _families  # noqa: F401 - registers the families
