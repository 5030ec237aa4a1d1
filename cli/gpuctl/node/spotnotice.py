"""AWS spot interruption notices: a job's watcher of the instance metadata, and the node's doomed mark.

EC2 gives a spot instance about two minutes between the notice and the end.
A job whose payload carries `spot_notice` ({"url", "interval_s"}) has its run
stage's relay poll IMDS (IMDSv2, IMDSv1 where no token is given) in a daemon
thread; on a notice it marks the node doomed (~/.gpuctl/doomed, kept until the
node goes: it is going away), sends the running ranks SIGTERM -- only TERM, so
they can checkpoint in the time left -- and leaves one line for the relay to
report in the job's events. `fence` (epochs.py) hands the doomed mark to the
controller. The thread acts at once (the two minutes count) but never emits:
the relay's loop does, so the events stream has one writer.
"""

import json
import os
import signal
import threading
import time

from gpuctl.node.jobdir import GPUCTL_DIR, cannot_write, read_text, write_private
from gpuctl.node.stages import signal_stage

DOOMED_FILE = os.path.join(GPUCTL_DIR, "doomed")  # JSON {"action", "time", "noticed_at"}
IMDS_URL = "http://169.254.169.254"  # where spot_notice names no url
IMDS_TOKEN_PATH = "/latest/api/token"
IMDS_NOTICE_PATH = "/latest/meta-data/spot/instance-action"
IMDS_TOKEN_TTL = 21600  # seconds a token is asked for (the longest IMDS gives)
IMDS_TIMEOUT = 1.0  # per request: a poll never holds the watcher longer than a few seconds
SPOT_INTERVAL = 5.0  # seconds between polls where spot_notice names no interval_s


def spot_notice_config(payload):
    """((url, interval_s), None) for a job that asks for the watcher, (None, None) for one that
    does not, (None, problem) for a field the agent cannot use."""
    spec = payload.get("spot_notice")
    if spec is None:
        return None, None
    if not isinstance(spec, dict):
        return None, "spot_notice must be an object {url, interval_s}, not %r" % (spec,)
    url = spec.get("url") or IMDS_URL
    interval = spec.get("interval_s")
    interval = SPOT_INTERVAL if interval is None else interval
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        return None, "spot_notice url %r is not an http(s) URL" % (url,)
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not interval > 0:
        return None, "spot_notice interval_s %r is not a number of seconds above 0" % (interval,)
    return (url.rstrip("/"), float(interval)), None


def imds_request(url, method="GET", headers=None, timeout=IMDS_TIMEOUT):
    """(HTTP status, body) of one metadata request, or None when the endpoint does not answer."""
    # Imported here, not at the top: urllib.request pulls in http.client and ssl, which every other
    # command of the agent would then load for nothing (the job plane's start-up is benchmarked).
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # IMDS is never behind a proxy
    request = urllib.request.Request(url, method=method, headers=dict(headers or {}))
    try:
        with opener.open(request, timeout=timeout) as answer:
            return answer.getcode(), answer.read(65536)
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except Exception:  # noqa: BLE001 - refused, timed out, a broken answer: no answer, never a dead watcher
        return None


def parse_notice(body):
    """The notice in a 200 answer ({"action", "time"}), or None for a body that is not one."""
    try:
        data = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("action"), str) or not data["action"]:
        return None
    when = data.get("time")
    return {"action": data["action"], "time": when if isinstance(when, str) else None}


def doomed_record():
    """The node's doomed mark (the notice that doomed it), or None."""
    text = read_text(DOOMED_FILE)
    if text is None:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return {"action": "unknown", "time": None, "noticed_at": None}  # a mark is a mark, even a torn one
    return data if isinstance(data, dict) else {"action": "unknown", "time": None, "noticed_at": None}


def mark_doomed(notice):
    """Write ~/.gpuctl/doomed (private); the record written, and why it could not be (or None)."""
    record = {"action": notice.get("action"), "time": notice.get("time"),
              "noticed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        os.makedirs(GPUCTL_DIR, 0o700, exist_ok=True)
        write_private(DOOMED_FILE, json.dumps(record))
    except OSError as exc:
        return record, cannot_write(exc, DOOMED_FILE)
    return record, None


class SpotWatch(object):
    """Polls IMDS for a spot notice every `interval` s in a daemon thread; acts on the first one.

    `stages()` gives the Stages to send SIGTERM (the job's run stage here). After
    a notice the thread ends: the node is doomed, one notice is all there is.
    """

    def __init__(self, url, interval, stages, timeout=IMDS_TIMEOUT):
        self.url = url.rstrip("/")
        self.interval = interval
        self.stages = stages
        self.timeout = timeout
        self.token = None
        self.token_until = 0.0
        self.record = None  # the doomed record, once noticed
        self._report = None  # the line for the job's events, until taken
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None

    def _token(self):
        """An IMDSv2 token, or None (IMDSv1: the GET goes without one)."""
        if self.token is None or time.time() >= self.token_until:
            got = imds_request(self.url + IMDS_TOKEN_PATH, "PUT",
                               {"X-aws-ec2-metadata-token-ttl-seconds": str(IMDS_TOKEN_TTL)}, self.timeout)
            ok = got is not None and got[0] == 200 and got[1].strip()
            self.token = got[1].decode("ascii", "replace").strip() if ok else None
            self.token_until = time.time() + (IMDS_TOKEN_TTL / 2 if ok else 0)
        return self.token

    def poll_once(self):
        """The notice IMDS gives now, or None (404: none; no answer; an answer that is not one)."""
        token = self._token()
        got = imds_request(self.url + IMDS_NOTICE_PATH, "GET",
                           {"X-aws-ec2-metadata-token": token} if token else {}, self.timeout)
        if got is None:
            return None
        if got[0] == 401:  # the token expired or IMDS wants one: ask again at the next poll
            self.token = None
            return None
        return parse_notice(got[1]) if got[0] == 200 else None

    def act(self, notice):
        """Mark the node doomed, leave the line to report, then SIGTERM the running stages'
        processes (no KILL: the ranks checkpoint). The line is left first so that the relay
        reports it ahead of the exits it causes; a mark that cannot be written (a full disk)
        is said in it and costs the ranks nothing."""
        running = [(st, st.pgid()) for st in self.stages() if st.exit_code() is None]
        running = [(st, pgid) for st, pgid in running if pgid is not None]
        record, problem = mark_doomed(notice)
        text = "spot interruption notice: %s at %s; %s%s" % (
            record["action"], record["time"] or "an unknown time",
            "ranks on this node got SIGTERM to checkpoint" if running else "no rank runs on this node",
            " (the node is not marked doomed: %s)" % problem if problem else "")
        with self._lock:
            self.record = record
            self._report = text
        for st, pgid in running:
            signal_stage(st, pgid, signal.SIGTERM)
        return text

    def take_report(self):
        """The notice's line for the job's events, once (None before a notice and after it was taken)."""
        with self._lock:
            text, self._report = self._report, None
        return text

    def _loop(self):
        while not self._stop.is_set():
            notice = None
            try:
                notice = self.poll_once()
                if notice is not None:
                    self.act(notice)
            except Exception:  # noqa: BLE001 - a watcher that dies would miss the one notice that matters
                pass
            if notice is not None:
                return  # one notice, acted on once (the signal is never sent twice)
            self._stop.wait(self.interval)

    def start(self):
        self._thread = threading.Thread(target=self._loop, name="gpuctl-spot-notice")
        self._thread.daemon = True
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
