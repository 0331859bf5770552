"""A stand-in for ``huggingface_hub.HfApi`` in push_to_hub tests: the two calls ``push_to_hub`` makes, the
uploaded folder copied under ``target`` (as ``repo_id`` with ``/`` -> ``--``, or ``folder_name(repo_id)``) so a
test can open it with plain ``transformers``. Used as ``mock.patch("huggingface_hub.HfApi", CopyingHub(target))``."""
from __future__ import annotations

import os
import shutil


class CopyingHub:
    def __init__(self, target: str, *, fail: bool = False, folder_name=None):
        self.target, self.fail = target, fail
        self.folder_name = folder_name or (lambda repo_id: repo_id.replace("/", "--"))

    def __call__(self, token=None):  # HfApi(token=...) -> the same recorder
        return self

    def create_repo(self, repo_id, private=None, exist_ok=False):
        if self.fail:
            raise ConnectionError("hub unreachable")

    def upload_folder(self, repo_id, folder_path, commit_message, revision=None):
        shutil.copytree(folder_path, os.path.join(self.target, self.folder_name(repo_id)))
        return f"uploaded {repo_id}"
