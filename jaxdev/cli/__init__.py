"""The ``jaxdev`` command: ``info``, ``demo``, ``bench``, ``memory``, ``launch``.

Loaded only by the command (``jaxdev`` or ``python -m jaxdev``), never by
``import jaxdev``. Imports anything below it, through the public names.
"""
