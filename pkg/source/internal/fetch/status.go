package fetch

import (
	"fmt"
	"io"
	"net/http"
	"net/url"

	"github.com/weightd/weightd/pkg/content"
)

// StatusError is an HTTP response status the source did not expect. It is
// wrapped with content.Permanent for statuses retrying cannot fix: 4xx other
// than 408, 425 and 429.
type StatusError struct {
	Method     string
	URL        string // redacted: no query
	StatusCode int
	Status     string
}

// Error says which request got which status.
func (e *StatusError) Error() string {
	return fmt.Sprintf("%s %s: HTTP %s", e.Method, e.URL, e.Status)
}

// ResponseError drains and closes resp's body and returns its status as a
// *StatusError, permanent where retrying cannot help.
func ResponseError(resp *http.Response, u *url.URL) error {
	DrainClose(resp.Body)
	err := &StatusError{Method: resp.Request.Method, URL: Redact(u), StatusCode: resp.StatusCode, Status: resp.Status}
	switch c := resp.StatusCode; {
	case c == http.StatusRequestTimeout, c == http.StatusTooEarly, c == http.StatusTooManyRequests:
		return err
	case c >= 400 && c < 500:
		return content.Permanent(err)
	default:
		return err
	}
}

// DrainClose reads a little of an unwanted body so the connection can be
// reused, and closes it.
func DrainClose(body io.ReadCloser) {
	_, _ = io.CopyN(io.Discard, body, 4<<10)
	body.Close()
}

// Redact drops the query (credentials in presigned URLs) from u for messages.
func Redact(u *url.URL) string {
	if u.RawQuery == "" {
		return u.String()
	}
	c := *u
	c.RawQuery = "REDACTED"
	return c.String()
}
