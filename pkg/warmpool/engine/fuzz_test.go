package engine

import (
	"errors"
	"net/http"
	"strings"
	"testing"
	"unicode/utf8"
)

var sentinels = []error{ErrUnsupported, ErrNotLoaded, ErrAlreadyLoaded, ErrRejected, ErrUnavailable}

// checkMapped fails unless err is nil or wraps exactly one sentinel and
// carries a bounded, valid message.
func checkMapped(t *testing.T, err error) {
	t.Helper()
	if err == nil {
		return
	}
	n := 0
	for _, s := range sentinels {
		if errors.Is(err, s) {
			n++
		}
	}
	if n != 1 {
		t.Fatalf("error %q wraps %d sentinels", err, n)
	}
	if msg := err.Error(); len(msg) > 8*maxMessage || !utf8.ValidString(msg) {
		t.Fatalf("unbounded or invalid message of %d bytes", len(msg))
	}
}

func FuzzVLLMError(f *testing.F) {
	for _, s := range []struct {
		status int
		body   string
	}{
		{200, "Success: LoRA adapter 'a' added successfully."},
		{400, `{"object":"error","message":"The lora adapter 'a' has already been loaded.","type":"InvalidUserInput","param":null,"code":400}`},
		{404, `{"object":"error","message":"The lora adapter 'a' cannot be found.","type":"NotFoundError","param":null,"code":404}`},
		{400, `{"error":{"message":"LoRA rank 128 is greater than max_lora_rank 64.","type":"BadRequestError","param":null,"code":400}}`},
		{404, `{"detail":"Not Found"}`},
		{500, `Internal Server Error`},
		{400, `{"error":"text"}`},
		{418, `{"message":null}`},
	} {
		f.Add(s.status, []byte(s.body), true)
		f.Add(s.status, []byte(s.body), false)
	}
	f.Fuzz(func(t *testing.T, status int, body []byte, unload bool) {
		err := vllmError(response{status: status, body: body}, unload)
		checkMapped(t, err)
		if status == http.StatusOK && err != nil {
			t.Fatalf("200 mapped to %v", err)
		}
		if status != http.StatusOK && err == nil {
			t.Fatalf("status %d mapped to success", status)
		}
	})
}

func FuzzSGLangError(f *testing.F) {
	for _, s := range []struct {
		status int
		body   string
	}{
		{200, `{"success":true,"error_message":null,"loaded_adapters":{"a":{"lora_id":"1","lora_name":"a","lora_path":"/p","pinned":false}}}`},
		{200, `{"success":true,"error_message":"","loaded_adapters":{"a":"/p"}}`},
		{400, `{"success":false,"error_message":"Failed to load LoRA adapter a because it is already loaded","loaded_adapters":null}`},
		{400, `{"success":false,"error_message":"LoRA with name a already exists. Loaded LoRAs: odict_keys(['a'])","loaded_adapters":null}`},
		{200, `{"success":true,"error_message":null,"loaded_adapters":{"a":["1","a","/p",true,true]}}`},
		{200, `{"success":true,"loaded_adapters":{"a":["1","a"]}}`},
		{200, `{"success":true,"loaded_adapters":{"":"/p"}}`},
		{400, `{"success":false,"error_message":"Failed to load LoRA adapter a as a pinned adapter. It is not allowed to pin all slots in the LoRA memory pool to avoid starvation for unpinned adapters and base models. Please increase your ` + "`--max-loras-per-batch`" + ` or load it as unpinned LoRA adapters."}`},
		{400, `{"success":false,"error_message":"LoRA with name a does not exist. Loaded LoRAs: dict_keys([])"}`},
		{400, `{"success":false,"error_message":"LoRA is not enabled. Please set ` + "`--enable-lora`" + ` to enable LoRA."}`},
		{200, `{"success":false}`},
		{200, `{"success":true,"loaded_adapters":{"a":7}}`},
		{422, `{"detail":[{"loc":["body","lora_name"],"msg":"field required"}]}`},
		{404, `{"detail":"Not Found"}`},
		{503, ``},
	} {
		f.Add(s.status, []byte(s.body), true)
		f.Add(s.status, []byte(s.body), false)
	}
	f.Fuzz(func(t *testing.T, status int, body []byte, unload bool) {
		loaded, err := sglangError(response{status: status, body: body}, unload)
		checkMapped(t, err)
		if err == nil && status != http.StatusOK {
			t.Fatalf("status %d mapped to success", status)
		}
		if _, ok := loaded[""]; ok {
			t.Fatalf("loaded_adapters decoded with an empty name: %v", loaded)
		}
	})
}

func FuzzDecodeModels(f *testing.F) {
	f.Add([]byte(`{"object":"list","data":[{"id":"base","object":"model","root":"/m","parent":null,"max_model_len":4096},{"id":"a","root":"/a","parent":"base","max_model_len":null}]}`))
	f.Add([]byte(`{"data":[{"id":"","parent":"b"}]}`))
	f.Add([]byte(`{"data":null}`))
	f.Add([]byte(`{"data":[{"id":"a","parent":"b"},{"id":"a","parent":"b"}]}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		as, err := decodeModels(body)
		checkMapped(t, err)
		if err != nil {
			return
		}
		seen := map[string]bool{}
		for _, a := range as {
			if a.Name == "" || a.Parent == "" || seen[a.Name] {
				t.Fatalf("decoded %+v", as)
			}
			seen[a.Name] = true
		}
	})
}

func TestQuoteBounded(t *testing.T) {
	t.Parallel()
	q := quote([]byte(strings.Repeat("é", 2*maxMessage) + "\xff"))
	if len(q) > maxMessage+16 || !utf8.ValidString(q) {
		t.Fatalf("quote is %d bytes", len(q))
	}
}
