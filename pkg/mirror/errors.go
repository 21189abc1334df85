package mirror

import (
	"encoding/json"
	"net/http"
	"strconv"
)

// apiError is a distribution API error: the status and one entry of the
// {"errors":[{"code","message"}]} body.
type apiError struct {
	status  int
	code    string
	message string
	// challenge asks the client for its credentials (WWW-Authenticate).
	challenge bool
}

func (e *apiError) Error() string { return e.code + ": " + e.message }

func errNotFound(code, msg string) *apiError {
	return &apiError{status: http.StatusNotFound, code: code, message: msg}
}

// Errors the handlers answer with.
var (
	errManifestUnknown = errNotFound("MANIFEST_UNKNOWN", "manifest unknown")
	errBlobUnknown     = errNotFound("BLOB_UNKNOWN", "blob unknown")
	errNameUnknown     = errNotFound("NAME_UNKNOWN", "registry not mirrored here")
	errUnavailable     = &apiError{status: http.StatusServiceUnavailable, code: "UNAVAILABLE", message: "upstream registry unavailable"}
	// errUnauthorized asks for the client's own credentials: containerd
	// answers a Basic challenge with its pull secret's, if it has one.
	errUnauthorized = &apiError{status: http.StatusUnauthorized, code: "UNAUTHORIZED", message: "the registry wants credentials", challenge: true}
	errDenied       = &apiError{status: http.StatusForbidden, code: "DENIED", message: "the registry refused the credentials"}
)

// challenge is the WWW-Authenticate of errUnauthorized.
const challenge = `Basic realm="weightd registry mirror"`

// write sends the error. A HEAD response carries the status and headers only.
func (e *apiError) write(w http.ResponseWriter, r *http.Request) {
	b, _ := json.Marshal(struct {
		Errors []errorEntry `json:"errors"`
	}{[]errorEntry{{Code: e.code, Message: e.message}}})
	h := w.Header()
	for _, k := range []string{"Docker-Content-Digest", "ETag", "Content-Range", "Accept-Ranges"} {
		h.Del(k)
	}
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(b)))
	if e.challenge {
		h.Set("WWW-Authenticate", challenge)
	}
	w.WriteHeader(e.status)
	if r.Method != http.MethodHead {
		_, _ = w.Write(b) // the client may be gone; nothing to do
	}
}

type errorEntry struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}
