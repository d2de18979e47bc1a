"""Consumer groups against the broker example, driven by kafka-python (a
client nobody on this project wrote).

Usage: group_scenario.py HOST:PORT

Two consumers in one group split four partitions; one leaves and the other
takes all four; a third is killed (SIGKILL, no leave) and the survivor takes
all four once its session expires; every record is read by the group (a
record read but not committed before a rebalance is read again, as Kafka
allows); commits survive a consumer restart. Prints one JSON line of timings and exits
0, or exits 1 with the reason.

The scenario steers around two races in kafka-python 3.0.12 (the client's,
not the broker's: Kafka answers the joins involved the same way):

- The client throws away the outcome of a join that completes while its
  consumer is outside `poll()`, and joins again. A join from the leader of a
  stable group begins a new round (in Kafka as in this broker), so two
  consumers polled in turn from one thread could restart rounds for as long
  as the test ran. Each consumer polls from a thread of its own, as
  applications run them.
- A leader that joined before it knew the topic's partitions joins again once
  it learns them; if that join completes after a `poll()` stopped waiting
  for it, the consumer stays in its rebalance for good. Each consumer loads the topic's metadata
  before it first polls.
"""

import json
import os
import queue
import subprocess
import sys
import threading
import time

from kafka import KafkaConsumer, KafkaProducer
from kafka.structs import TopicPartition

SERVER = sys.argv[1]
TOPIC = "groups"
GROUP = "scenario"
SESSION_MS = 6000
# Guards every list of records read (a list may be shared by two members).
SEEN = threading.Lock()


# The victim's process, while it runs (killed on the way out).
VICTIM = None


def fail(why):
    print(f"FAIL: {why}", file=sys.stderr, flush=True)
    if VICTIM is not None:
        VICTIM.kill()
    # Polling threads may still be inside the client: leave without them.
    os._exit(1)


def consumer(name):
    return KafkaConsumer(
        TOPIC,
        bootstrap_servers=SERVER,
        group_id=GROUP,
        client_id=name,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        session_timeout_ms=SESSION_MS,
        heartbeat_interval_ms=300,
        max_poll_interval_ms=60000,
        fetch_max_wait_ms=100,
    )


class Member:
    """A consumer polled without pause by a thread of its own. What it reads
    goes into `seen`; anything else done with it (commit, close) runs on that
    thread between two polls."""

    def __init__(self, name, seen):
        self.name = name
        self.seen = seen
        self.lock = threading.Lock()
        self.held = []
        self.state = None
        self.error = None
        self.jobs = queue.Queue()
        self.consumer = consumer(name)
        partitions = self.consumer.partitions_for_topic(TOPIC)
        if partitions != {0, 1, 2, 3}:
            fail(f"{name} sees partitions {partitions}")
        self.thread = threading.Thread(target=self._run, name=f"poll-{name}", daemon=True)
        self.thread.start()

    def _run(self):
        c = self.consumer
        try:
            while True:
                try:
                    job, done = self.jobs.get_nowait()
                except queue.Empty:
                    job = None
                if job is not None:
                    try:
                        done.put((True, job(c)))
                    except Exception as e:
                        done.put((False, repr(e)))
                        raise
                    if job is Member._close:
                        return
                for tp, records in c.poll(timeout_ms=100).items():
                    with SEEN:
                        self.seen.extend((tp.partition, r.offset, r.value) for r in records)
                held = sorted(p.partition for p in c.assignment())
                with self.lock:
                    self.held = held
                    self.state = f"{c._coordinator.state} {c._coordinator._generation}"
        except Exception as e:  # reported by whoever waits on this member
            with self.lock:
                self.error = repr(e)

    @staticmethod
    def _close(c):
        c.close()

    def run(self, job, what):
        """Runs job(consumer) on the polling thread; returns its result."""
        done = queue.Queue()
        self.jobs.put((job, done))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                ok, result = done.get(timeout=0.1)
            except queue.Empty:
                if self.thread.is_alive():
                    continue
                # The thread ended: with the answer put just before, or not.
                try:
                    ok, result = done.get_nowait()
                except queue.Empty:
                    self.check()
                    fail(f"{self.name} stopped polling before it could {what}")
            if not ok:
                fail(f"{self.name} could not {what}: {result}")
            return result
        fail(f"{self.name} did not {what} within 30 s")

    def close(self):
        self.run(Member._close, "close")
        self.thread.join(timeout=30)

    def check(self):
        """Fails the scenario if the polling thread has failed or ended."""
        with self.lock:
            error = self.error
        if error is not None:
            fail(f"{self.name} failed: {error}")
        if not self.thread.is_alive():
            fail(f"{self.name} stopped polling")

    def parts(self):
        self.check()
        with self.lock:
            return list(self.held)

    def describe(self):
        with self.lock:
            return f"{self.name}: {self.held} {self.state} (error: {self.error})"


def wait_until(members, cond, what, limit=20.0):
    deadline = time.monotonic() + limit
    while True:
        for m in members:
            m.check()
        if cond():
            return
        if time.monotonic() > deadline:
            fail(f"timed out waiting for {what}; {', '.join(m.describe() for m in members)}")
        time.sleep(0.02)


def records(seen):
    with SEEN:
        return list(seen)


def main():
    global VICTIM
    if len(sys.argv) > 2 and sys.argv[2] == "--victim":
        # The consumer that gets killed: joins, then waits to be killed (or
        # exits, with no LeaveGroup, once the scenario that started it is gone).
        parent = int(sys.argv[3])

        def orphaned():
            while os.getppid() == parent:
                time.sleep(0.2)
            os._exit(1)

        threading.Thread(target=orphaned, daemon=True).start()
        victim = Member("victim", [])
        wait_until([victim], lambda: len(victim.parts()) > 0, "the victim's assignment")
        print("joined", flush=True)
        while True:
            time.sleep(1)

    timings = {}
    producer = KafkaProducer(bootstrap_servers=SERVER, acks=1)
    for i in range(40):
        producer.send(TOPIC, value=b"r%d" % i, partition=i % 4)
    producer.flush(timeout=10)

    seen = []
    t = time.monotonic()
    c1 = Member("c1", seen)
    wait_until([c1], lambda: c1.parts() == [0, 1, 2, 3], "c1 alone to hold all four")
    timings["first_join_s"] = round(time.monotonic() - t, 3)

    t = time.monotonic()
    c2 = Member("c2", seen)
    wait_until(
        [c1, c2],
        lambda: len(c1.parts()) == 2 and len(c2.parts()) == 2,
        "c1 and c2 to split the four partitions",
    )
    timings["rebalance_on_join_s"] = round(time.monotonic() - t, 3)
    if sorted(c1.parts() + c2.parts()) != [0, 1, 2, 3]:
        fail(f"split {c1.parts()} / {c2.parts()}")

    # Read all forty, then commit what each holds.
    def distinct():
        return {(p, o) for p, o, _ in records(seen)}

    wait_until([c1, c2], lambda: len(distinct()) >= 40, "all 40 records")
    c1.run(lambda c: c.commit(), "commit")
    c2.run(lambda c: c.commit(), "commit")

    t = time.monotonic()
    c2.close()  # a LeaveGroup
    wait_until([c1], lambda: c1.parts() == [0, 1, 2, 3], "c1 to take all four after c2 left")
    timings["rebalance_on_leave_s"] = round(time.monotonic() - t, 3)

    victim = VICTIM = subprocess.Popen(
        [sys.executable, __file__, SERVER, "--victim", str(os.getpid())],
        stdout=subprocess.PIPE,
        text=True,
    )
    wait_until([c1], lambda: len(c1.parts()) < 4, "the victim to take a share")
    line = victim.stdout.readline()
    if line.strip() != "joined":
        fail(f"the victim said {line!r}")
    t = time.monotonic()
    victim.kill()
    victim.wait()
    VICTIM = None
    wait_until(
        [c1],
        lambda: c1.parts() == [0, 1, 2, 3],
        "c1 to take all four after the victim was killed",
        limit=SESSION_MS / 1000 + 10,
    )
    timings["rebalance_after_kill_s"] = round(time.monotonic() - t, 3)

    # Every record read by the group, and nothing else (the victim may have
    # read some of its share; nothing was committed for those, so c1 reads
    # them again).
    if distinct() != {(p, o) for p in range(4) for o in range(10)}:
        fail(f"read {len(distinct())} distinct records, not the 40 produced")
    c1.run(lambda c: c.commit(), "commit")
    c1.close()

    # A restarted consumer starts from the commits: only what is new.
    for i in range(4):
        producer.send(TOPIC, value=b"new%d" % i, partition=i)
    producer.flush(timeout=10)
    again = []
    c3 = Member("c3", again)
    wait_until([c3], lambda: len(records(again)) >= 4, "the four new records after a restart")
    time.sleep(0.3)  # anything read after these four would be a replay
    read = sorted(v for _, _, v in records(again))
    if read != [b"new0", b"new1", b"new2", b"new3"]:
        fail(f"after a restart read {read}")
    committed = c3.run(
        lambda c: {p: c.committed(TopicPartition(TOPIC, p)) for p in range(4)}, "read its commits"
    )
    c3.run(lambda c: c.commit(), "commit")
    c3.close()
    producer.close()
    timings["committed_before_restart"] = committed
    print(json.dumps(timings))


if __name__ == "__main__":
    main()
