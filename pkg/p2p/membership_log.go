package p2p

import (
	"bytes"
	"context"
	"log/slog"
)

// memberlistLogWriter carries memberlist's log lines ("[WARN] memberlist:
// ...") to a slog.Logger, all at debug level, memberlist's own level kept as
// an attribute.
type memberlistLogWriter struct{ log *slog.Logger }

func (w memberlistLogWriter) Write(p []byte) (int, error) {
	if !w.log.Enabled(context.Background(), slog.LevelDebug) {
		return len(p), nil
	}
	line := bytes.TrimRight(p, "\n")
	level := "INFO"
	if rest, ok := bytes.CutPrefix(line, []byte("[")); ok {
		if tag, msg, ok := bytes.Cut(rest, []byte("] ")); ok && len(tag) <= 5 {
			level, line = string(tag), msg
		}
	}
	w.log.Debug(string(line), "memberlist_level", level)
	return len(p), nil
}
