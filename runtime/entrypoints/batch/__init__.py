"""``specray batch``: a JSONL file of requests in, their outputs out, in input order
(``job``); local paths and pyarrow URIs (``files``); and the checkpoint a job run again
resumes from (``checkpoint``)."""
