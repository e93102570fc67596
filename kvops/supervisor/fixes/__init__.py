"""The supervisor's fixes, from a diagnosis to a verdict and, when it did not help, an undo.

- `manager`: the policy per rule (off / suggest / auto) on the poll loop, and the API's apply and revert;
- `jobs`: a fix job's life off the poll loop (apply, verify, judge, roll back), on `runner`'s worker threads;
- `state`: the jobs and each managed engine's last good settings, persisted across a supervisor restart;
- `judge` and `measures`: the verdict, from windows of snapshots before and after the change;
- `audit`: the log of every step; `lease`: which of two supervisors on one engine applies fixes;
- `gateway`: the fixes of kind `gateway`, made on a `kvops gateway`'s admin API.
"""
