r"""The skill pack and the scaffolder, torch-free: ``skills`` (find, list, show), ``skill_check`` (validate
against the Agent Skills spec), ``installer`` (link into agent folders, never replacing a user's file),
``scaffold`` (render ``templates/`` into tests, pipeline stubs and scripts)."""
