package engine

import (
	"errors"
	"net/http"
	"testing"
)

// vLLM's duplicate-name answer kept its prefix when v0.14 (PR 31326,
// load_inplace) appended a hint: both are ErrAlreadyLoaded.
func TestVLLMDuplicateNameAcrossReleases(t *testing.T) {
	for _, msg := range []string{
		"The lora adapter 'a' has already been loaded.",
		"The lora adapter 'a' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to true.",
	} {
		body := `{"object":"error","message":"` + msg + `","type":"InvalidUserInput","param":null,"code":400}`
		if err := vllmError(response{status: http.StatusBadRequest, body: []byte(body)}, false); !errors.Is(err, ErrAlreadyLoaded) {
			t.Errorf("%q: %v, want ErrAlreadyLoaded", msg, err)
		}
	}
}
