"""fetch-model: the recipe's checkpoint from a Hugging Face Hub onto the head, pinned, resumable, verified.

- access.py   the endpoint and the token (a secret: never in an argv, a log, a plan or a run record);
- resolve.py  before planning: which commit the run uses and which files (the Hub's metadata, or the
              head's cache when the run does not fetch), and whether the head already holds them;
- job.py      the download as one container run on the head (the serving image has the Hub's client);
- hostside/hubfetch.py is what runs on the head (resolve and check with its python3, fetch in the image).
"""
