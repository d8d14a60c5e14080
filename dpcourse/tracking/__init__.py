"""What each rank records about its communication: the calls it issues, what its main thread
waits in, and its traffic.

A rank's process -- a pool rank, or a worker torchrun starts for an exercise's check -- runs
one ``CollectiveTracker`` (``tracker.TRACKER``). It notes every collective and point-to-point
call as it is issued (``records.Issued``, told to the course's observers), the communication
the main thread is blocked in (``records.Wait``, so a hang reads "waiting in the 3rd
all_reduce of this call" and a deadlock is decided from recorded waits), and the call's
*traffic* (``records.Traffic``: messages sent and received by group and peer, collectives
issued by group). The pool carries these records to the kernel, which decides from them
alone whether a call can still finish and what it left in flight.

This room imports nothing of the pool's, nor of the lessons': ``pool``, ``observe`` and
``exercises`` read it. Its modules: ``records`` (the frozen records, and ``ordinal`` that
words their numbers), ``learners`` (which code is the learner's), ``tracker`` (the recording
itself, installed on the c10d operators and the point-to-point functions).
"""
